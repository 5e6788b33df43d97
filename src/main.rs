//! The `bloomgate` binary: parses the command line, loads the config, sets up logging and
//! hands over to the library. Config errors exit with status 2.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use bloomgate::config::{Compiled, Config, LogFormat};
mod cli;

use bloomgate::{App, reload_on_sighup, shutdown_signal};
use clap::{Parser, Subcommand, ValueEnum};
use cli::demo::{self, DemoOptions};
use prometheus::Registry;
use tracing_subscriber::EnvFilter;

/// Cached entries live for minutes between buffers that live for one request; glibc's
/// malloc lets the one pin the other's pages (docs/BENCHMARKS.md, Memory).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// A caching reverse proxy with a Bloom gate against cache penetration.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    /// Log format; overrides `log.format` from the config.
    #[arg(long, global = true, value_enum)]
    log_format: Option<CliLogFormat>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum CliLogFormat {
    Human,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy.
    Serve {
        /// Path to the TOML config.
        #[arg(long, default_value = "config.toml")]
        config: PathBuf,
    },
    /// Validate a config file (with environment overrides) and exit.
    CheckConfig {
        /// Path to the TOML config.
        #[arg(long, default_value = "config.toml")]
        config: PathBuf,
    },
    /// Build or inspect filter snapshots offline.
    Filter {
        #[command(subcommand)]
        command: FilterCommand,
    },
    /// Run the whole pipeline on an embedded SQLite database with demo products.
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
}

#[derive(Subcommand)]
enum FilterCommand {
    /// Stream the source query into a filter (with progress) and write its snapshot.
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
    Inspect {
        /// The snapshot file.
        path: PathBuf,
    },
}

const EXIT_CONFIG: u8 = 2;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::CheckConfig { config } => match Config::load_compiled(&config) {
            Ok(c) => {
                println!(
                    "{}: ok ({} filters, {} routes)",
                    config.display(),
                    c.filters().len(),
                    c.routes().len()
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{}: {e}", config.display());
                ExitCode::from(EXIT_CONFIG)
            }
        },
        Command::Serve { config } => {
            let compiled = match Config::load_compiled(&config) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("{}: {e}", config.display());
                    return ExitCode::from(EXIT_CONFIG);
                }
            };
            let log = &compiled.config().log;
            init_tracing(cli.log_format.map_or(log.format, to_format), &log.level);
            report(runtime().and_then(|rt| rt.block_on(serve(compiled, &config))))
        }
        Command::Filter { command } => match command {
            FilterCommand::Inspect { path } => report(cli::filter::inspect(&path)),
            FilterCommand::Build {
                config,
                filter,
                out,
            } => {
                let cfg = match Config::load(&config) {
                    Ok(c) => c,
                    Err(e) => {
                        eprintln!("{}: {e}", config.display());
                        return ExitCode::from(EXIT_CONFIG);
                    }
                };
                init_tracing(
                    cli.log_format.map_or(cfg.log.format, to_format),
                    &cfg.log.level,
                );
                report(runtime().and_then(|rt| {
                    rt.block_on(cli::filter::build(&cfg, filter.as_deref(), out.as_deref()))
                }))
            }
        },
        Command::Demo {
            products,
            db,
            listen,
            admin_listen,
        } => {
            init_tracing(cli.log_format.map_or(LogFormat::Human, to_format), "info");
            let opts = DemoOptions {
                products,
                db_path: db,
                listen,
                admin_listen,
            };
            report(runtime().and_then(|rt| rt.block_on(demo::run(opts))))
        }
    }
}

async fn serve(compiled: Compiled, path: &Path) -> anyhow::Result<()> {
    let app = App::build_from_file(compiled, path, Registry::new())
        .await
        .context("starting bloomgate")?;
    // Ends with the runtime, after `run` returns.
    tokio::spawn(reload_on_sighup(app.reloader()));
    app.run(shutdown_signal()).await;
    Ok(())
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

fn report(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "bloomgate stopped with an error");
            eprintln!("error: {e:#}");
            if e.downcast_ref::<bloomgate::config::ConfigError>().is_some() {
                ExitCode::from(EXIT_CONFIG)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

fn to_format(f: CliLogFormat) -> LogFormat {
    match f {
        CliLogFormat::Human => LogFormat::Human,
        CliLogFormat::Json => LogFormat::Json,
    }
}

fn init_tracing(format: LogFormat, level: &str) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Human => builder.init(),
    }
}
