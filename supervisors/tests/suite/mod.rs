mod common;
mod config;
mod events;
mod services;
mod supervision;
mod tasks;
mod teardown;
mod tree;
