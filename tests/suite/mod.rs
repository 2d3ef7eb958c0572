mod cli;
mod conformance;
mod embedding;
mod peers;
mod persistence;
mod run;
