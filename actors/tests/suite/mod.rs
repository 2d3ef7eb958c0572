mod agent;
mod durability;
mod harness;
mod prompt;
mod subagent;
mod workflow;
