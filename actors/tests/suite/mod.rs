mod agent;
mod durability;
mod harness;
mod prompt;
mod ralph;
mod subagent;
mod workflow;
