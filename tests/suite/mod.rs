mod cli;
mod embedding;
mod run;
