mod common;
mod events;
mod services;
mod supervision;
mod teardown;
mod tree;
