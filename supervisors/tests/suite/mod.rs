mod common;
mod config;
mod events;
mod services;
mod supervision;
mod teardown;
mod tree;
