mod cli;
mod conformance;
mod embedding;
mod run;
