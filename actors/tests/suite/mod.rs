mod agent;
mod harness;
mod prompt;
