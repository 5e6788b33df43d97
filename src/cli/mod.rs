//! The command line: its grammar (`args`) and the subcommands other than `serve`: the
//! demo, the offline filter tools, `init` and the manual pages. Everything that prints for
//! a person lives here; the library only returns values.

pub mod args;
pub mod check;
pub mod demo;
pub mod filter;
pub mod init;
pub mod inspect;
pub mod man;
