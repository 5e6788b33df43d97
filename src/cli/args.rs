//! The command line's grammar: every subcommand and flag, its default and its help text.
//! Parsing only; what each subcommand does is in `main.rs` and the other `cli` modules.
//! `tests/cli_doc.rs` includes this file to hold `docs/cli.md` to it.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

/// `--version`: the crate's version and the commit it was built from (`build.rs`).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("BLOOMGATE_GIT_COMMIT"),
    ")"
);

/// A caching reverse proxy with a Bloom gate against cache penetration.
#[derive(Parser)]
#[command(
    name = "bloomgate",
    version = VERSION,
    about,
    after_help = "Example:\n  bloomgate init --database-url mysql://app@db/shop --table products --key sku_id -o bloomgate.toml\n  bloomgate serve --config bloomgate.toml"
)]
pub struct Cli {
    /// Log format; overrides `log.format` from the config.
    #[arg(long, global = true, value_enum)]
    pub log_format: Option<CliLogFormat>,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// `--log-format`.
#[derive(Clone, Copy, ValueEnum)]
pub enum CliLogFormat {
    /// Readable lines for a terminal.
    Human,
    /// One JSON object per line.
    Json,
}

/// The subcommands.
#[derive(Subcommand)]
pub enum Command {
    /// Run the proxy.
    #[command(after_help = "Example:\n  bloomgate serve --config /etc/bloomgate/config.toml")]
    Serve {
        /// Path to the TOML config.
        #[arg(long, default_value = "config.toml")]
        config: PathBuf,
    },
    /// Validate a config file (with environment overrides) and exit.
    #[command(after_help = "Example:\n  bloomgate check-config --config config.toml")]
    CheckConfig {
        /// Path to the TOML config.
        #[arg(long, default_value = "config.toml")]
        config: PathBuf,
    },
    /// Build or inspect filter snapshots offline.
    #[command(
        after_help = "Example:\n  bloomgate filter build --config config.toml --filter products --out products.bloom"
    )]
    Filter {
        /// What to do with a filter.
        #[command(subcommand)]
        command: FilterCommand,
    },
    /// Run the whole pipeline on an embedded SQLite database with demo products.
    #[command(after_help = "Example:\n  bloomgate demo --products 10000 --listen 127.0.0.1:8080")]
    Demo {
        /// Number of demo products seeded when the table is empty.
        #[arg(long, default_value_t = 1_000_000)]
        products: u64,
        /// SQLite database file.
        #[arg(long, default_value = "data/demo.db")]
        db: PathBuf,
        /// Data-plane address.
        #[arg(long, default_value = "0.0.0.0:8080")]
        listen: SocketAddr,
        /// Admin-plane address.
        #[arg(long, default_value = "127.0.0.1:9090")]
        admin_listen: SocketAddr,
    },
    /// Write a config that gates one table, read from the table's metadata.
    #[command(
        after_help = "Example:\n  bloomgate init --database-url mysql://app@db:3306/shop --table products --key sku_id \\\n      --route '/api/product/info?sku_id={key}' -o bloomgate.toml"
    )]
    Init(InitArgs),
    /// Print a shell completion script to standard output.
    #[command(
        after_help = "Example:\n  bloomgate completions bash > /etc/bash_completion.d/bloomgate"
    )]
    Completions {
        /// The shell to complete in.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page, or write one per subcommand into a directory.
    #[command(after_help = "Example:\n  bloomgate man --out-dir /usr/local/share/man/man1")]
    Man {
        /// Write bloomgate.1 and a page per subcommand (bloomgate-serve.1, …) here instead
        /// of printing bloomgate.1.
        #[arg(long)]
        out_dir: Option<PathBuf>,
    },
}

/// `bloomgate init`.
#[derive(clap::Args)]
pub struct InitArgs {
    /// The database holding the table: mysql://, mariadb:// or sqlite:// (read only).
    /// Without it, BLOOMGATE__DATABASE__URL is read, which keeps a password off the
    /// command line.
    #[arg(long)]
    pub database_url: Option<String>,
    /// The table whose keys the gate lists.
    #[arg(long)]
    pub table: String,
    /// The key column: unique and indexed.
    #[arg(long)]
    pub key: String,
    /// The guarded route, with {key} where the key is: /api/items/{key} or
    /// /api/item?id={key} (default: /api/<table>/{key}).
    #[arg(long)]
    pub route: Option<String>,
    /// Fetch found keys from this HTTP API (http://host:port) instead of the table.
    #[arg(long)]
    pub upstream: Option<String>,
    /// Write the config here instead of standard output.
    #[arg(short = 'o', long)]
    pub output: Option<PathBuf>,
    /// Overwrite the --output file if it exists.
    #[arg(long)]
    pub force: bool,
}

/// `bloomgate filter …`.
#[derive(Subcommand)]
pub enum FilterCommand {
    /// Stream the source query into a filter (with progress) and write its snapshot.
    #[command(
        after_help = "Example:\n  bloomgate filter build --config config.toml --filter products"
    )]
    Build {
        /// Path to the TOML config.
        #[arg(long, default_value = "config.toml")]
        config: PathBuf,
        /// Only this filter (required with --out when there are several).
        #[arg(long)]
        filter: Option<String>,
        /// Where to write, instead of the filter's snapshot_path.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Verify a snapshot and print its parameters, items, fill ratio, watermark and age.
    #[command(after_help = "Example:\n  bloomgate filter inspect data/products.bloom")]
    Inspect {
        /// The snapshot file.
        path: PathBuf,
    },
}
