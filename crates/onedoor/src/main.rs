//! The `onedoor` command line: `serve`, `demo`, `validate`, `keys` (`new`, and the admin API's
//! runtime keys), `usage report`, `mock`.
//! Each command wires parts together; the parts hold the logic.

mod admin_client;
mod allocator;
mod demo;
mod keys;
mod usage;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use onedoor_gateway::StartError;

#[derive(Parser)]
#[command(
    name = "onedoor",
    version,
    about = "One door to many model endpoints: an LLM gateway."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway on a config file.
    Serve {
        /// The config file (YAML).
        #[arg(long, env = "ONEDOOR_CONFIG", default_value = "onedoor.yaml")]
        config: PathBuf,
    },
    /// Run the gateway in front of a simulated fleet of upstreams, on an embedded config.
    Demo {
        /// The client port on 127.0.0.1.
        #[arg(long, default_value_t = 8080)]
        port: u16,
    },
    /// Check a config file without starting anything.
    Validate {
        /// The config file (YAML).
        #[arg(long, env = "ONEDOOR_CONFIG", default_value = "onedoor.yaml")]
        config: PathBuf,
    },
    /// Client keys.
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
    },
    /// Usage records: chargeback reports.
    Usage {
        #[command(subcommand)]
        command: UsageCommand,
    },
    /// Run simulated upstreams only (for tests, benchmarks and trying configs).
    Mock {
        /// The fleet description (YAML with `endpoints:`).
        #[arg(long, default_value = "mock.yaml")]
        config: PathBuf,
    },
}

#[derive(Subcommand)]
enum UsageCommand {
    /// Tokens, requests and cost per group from the usage store, with how far the gateway's
    /// token estimates drifted from what upstreams measured.
    Report(usage::ReportArgs),
}

#[derive(Subcommand)]
enum KeysCommand {
    /// Print a fresh random client key and its `sha256:` hash for the config.
    New,
    /// Runtime keys, through the admin API.
    #[command(flatten)]
    Runtime(Box<keys::Runtime>),
}

fn main() -> ExitCode {
    onedoor_gateway::set_lane_housekeeping(allocator::return_freed_memory);
    let cli = Cli::parse();
    init_logs();
    match cli.command {
        Command::Validate { config } => validate(&config),
        Command::Keys {
            command: KeysCommand::New,
        } => {
            print!("{}", keys::new_key_text());
            ExitCode::SUCCESS
        }
        Command::Keys {
            command: KeysCommand::Runtime(command),
        } => run(keys::run(*command)),
        Command::Serve { config } => run(serve(config)),
        Command::Demo { port } => run(demo::run(port)),
        Command::Usage {
            command: UsageCommand::Report(args),
        } => run(usage::report(args)),
        Command::Mock { config } => run(mock(config)),
    }
}

fn init_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("ONEDOOR_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// Runs an async command on a multi-threaded runtime; its error is a runtime failure (exit 2)
/// unless it says it was bad input (exit 1).
fn run(command: impl std::future::Future<Output = Result<(), Failure>>) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("onedoor: cannot start the async runtime: {error}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::BadInput(message)) => {
            eprintln!("{message}");
            ExitCode::from(1)
        }
        Err(Failure::Runtime(message)) => {
            eprintln!("onedoor: {message}");
            ExitCode::from(2)
        }
    }
}

pub enum Failure {
    BadInput(String),
    Runtime(String),
}

fn problems_text(problems: &[onedoor_config::Problem]) -> String {
    problems
        .iter()
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

fn validate(config: &std::path::Path) -> ExitCode {
    match onedoor_config::load(config) {
        Ok(snapshot) => {
            println!("{}", onedoor_config::summary(&snapshot));
            ExitCode::SUCCESS
        }
        Err(problems) => {
            println!("{}", problems_text(&problems));
            eprintln!("{} problem(s) in {}", problems.len(), config.display());
            ExitCode::from(1)
        }
    }
}

async fn serve(config: PathBuf) -> Result<(), Failure> {
    onedoor_gateway::configure_idle_poll().map_err(Failure::BadInput)?;
    let running = onedoor_gateway::start_from_file(&config)
        .await
        .map_err(|error| match error {
            StartError::Config(problems) => Failure::BadInput(problems_text(&problems)),
            StartError::Listen(error) => Failure::Runtime(format!("cannot listen: {error}")),
        })?;
    tracing::info!(addr = %running.addr(), admin = %running.admin_addr(), config = %config.display(), "onedoor is serving");
    let signal = tokio::select! {
        signal = stop_signal() => signal,
        _ = reload_on_hangup(&running) => Signal::Terminate,
    };
    tracing::info!(
        ?signal,
        "shutting down: requests under way finish first (a second signal stops at once)"
    );
    // SIGTERM is a platform's stop (Kubernetes, systemd): drain first. Ctrl-C is a person's.
    let stopping = async {
        match signal {
            Signal::Terminate => running.drain_and_shutdown().await,
            Signal::Interrupt => running.shutdown().await,
        }
    };
    tokio::select! {
        () = stopping => tracing::info!("stopped"),
        _ = stopped() => tracing::warn!("second signal: stopping without waiting for requests under way"),
    }
    Ok(())
}

/// Reloads the config on every SIGHUP; never returns where that signal exists.
async fn reload_on_hangup(running: &onedoor_gateway::Running) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let Ok(mut hangup) = signal(SignalKind::hangup()) else {
            return std::future::pending().await;
        };
        while hangup.recv().await.is_some() {
            tracing::info!("SIGHUP: reloading the config");
            // Success and refusal (with every problem) are logged by the reload itself.
            let _ = running.reload().await;
        }
    }
    std::future::pending().await
}

async fn mock(config: PathBuf) -> Result<(), Failure> {
    let text = std::fs::read_to_string(&config)
        .map_err(|e| Failure::BadInput(format!("cannot read {}: {e}", config.display())))?;
    let fleet = onedoor_mock::run_from_yaml(&text)
        .await
        .map_err(Failure::BadInput)?;
    let issuers = onedoor_mock::issuers_from_yaml(&text)
        .await
        .map_err(Failure::BadInput)?;
    for endpoint in fleet.endpoints() {
        println!("{}\t{}", endpoint.name(), endpoint.url());
    }
    for (name, issuer) in &issuers {
        println!("{name}\t{}", issuer.url());
    }
    stopped().await;
    fleet.shutdown().await;
    Ok(())
}

/// The signal that asked the gateway to stop.
#[derive(Debug, Clone, Copy)]
enum Signal {
    /// Ctrl-C (SIGINT).
    Interrupt,
    /// SIGTERM.
    Terminate,
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn stopped() {
    stop_signal().await;
}

/// Resolves on Ctrl-C or SIGTERM, saying which.
async fn stop_signal() -> Signal {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(signal) => signal,
                Err(_) => {
                    let _ = interrupt.await;
                    return Signal::Interrupt;
                }
            };
        tokio::select! {
            _ = interrupt => Signal::Interrupt,
            _ = terminate.recv() => Signal::Terminate,
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
        Signal::Interrupt
    }
}
