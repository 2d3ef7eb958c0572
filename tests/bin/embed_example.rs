//! `examples/embed.rs` as a binary (`dsh-embed-example`), so the suite runs
//! the example as a real process (`CARGO_BIN_EXE_…`), as written.

#[path = "../../examples/embed.rs"]
mod example;

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    example::main()
}
