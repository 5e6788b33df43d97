//! The command line's subcommands other than `serve`: the demo and the offline filter
//! tools. Everything that prints for a person lives here; the library only returns values.

pub mod demo;
pub mod filter;
