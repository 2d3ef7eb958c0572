mod agent;
mod durability;
mod harness;
mod hibernate;
mod prompt;
mod ralph;
mod subagent;
mod workflow;
