//! The `bloomgate` binary: parses the command line, loads the config, sets up logging and
//! hands over to the library. Config errors exit with status 2.

use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;
use bloomgate::config::{Compiled, Config, LogFormat};
use bloomgate::report::Chain;
mod cli;

use bloomgate::{App, reload_on_sighup, shutdown_signal};
use clap::{CommandFactory, Parser};
use cli::args::{Cli, CliLogFormat, Command, FilterCommand};
use cli::demo::{self, DemoOptions};
use prometheus::Registry;
use tracing_subscriber::EnvFilter;

/// Cached entries live for minutes between buffers that live for one request; glibc's
/// malloc lets the one pin the other's pages (docs/BENCHMARKS.md, Memory).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
                for note in cli::check::binlog_notes(&c) {
                    println!("{note}");
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{}: {}", config.display(), Chain(&e));
                ExitCode::from(EXIT_CONFIG)
            }
        },
        Command::Serve { config } => {
            let compiled = match Config::load_compiled(&config) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("{}: {}", config.display(), Chain(&e));
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
                        eprintln!("{}: {}", config.display(), Chain(&e));
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
        Command::Init(args) => cli::init::main(args),
        Command::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "bloomgate",
                &mut std::io::stdout(),
            );
            ExitCode::SUCCESS
        }
        Command::Man { out_dir } => report(cli::man::write(Cli::command(), out_dir.as_deref())),
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
            let chain = Chain(e.as_ref());
            tracing::error!(error = %chain, "bloomgate stopped with an error");
            eprintln!("error: {chain}");
            let refused_source = matches!(
                e.downcast_ref::<bloomgate::app::AppError>(),
                Some(bloomgate::app::AppError::Binlog { .. })
            );
            if e.downcast_ref::<bloomgate::config::ConfigError>().is_some() || refused_source {
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
