mod cli;
mod conformance;
mod embedding;
mod multi;
mod peers;
mod persistence;
mod run;
mod web;
