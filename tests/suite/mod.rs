mod cli;
mod embedding;
