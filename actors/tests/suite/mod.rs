mod agent;
mod harness;
