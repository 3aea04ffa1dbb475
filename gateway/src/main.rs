//! The `agentgate` command: `serve` runs the gateway; `openapi` prints its API description;
//! `hash-key` prints the digest to put in a team's `api_key_sha256` (of its argument, or of the
//! first line of standard input).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use agentgate::{Config, Gateway};

/// OpenAI Responses API gateway for vLLM and SGLang fleets.
#[derive(Parser, Debug)]
#[command(name = "agentgate", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the gateway.
    Serve {
        /// Configuration file (TOML); see examples/quickstart.toml.
        #[arg(long)]
        config: PathBuf,
        /// Listen address (an IP address and port, such as 127.0.0.1:8080; `localhost:PORT`
        /// is 127.0.0.1), overriding `[server] listen`.
        #[arg(long, value_parser = parse_listen)]
        listen: Option<SocketAddr>,
        /// Store URL (`redis://host:port/db`), overriding `[store] url`.
        #[arg(long)]
        store: Option<String>,
    },
    /// Print the OpenAPI document (YAML) of every endpoint the gateway serves.
    Openapi,
    /// Print the SHA-256 digest of an API key, for `[[teams]] api_key_sha256`.
    HashKey {
        /// The key; without it (or with `-`) the first line of standard input, which keeps the
        /// key out of shell history and process lists.
        key: Option<String>,
    },
}

fn init_logging() {
    let filter: tracing_subscriber::filter::Targets = std::env::var("RUST_LOG")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| "info".parse().unwrap_or_default());
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let _ = tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())),
        )
        .with(filter)
        .try_init();
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}

async fn serve(
    config: PathBuf,
    listen: Option<SocketAddr>,
    store: Option<String>,
) -> Result<(), String> {
    let mut cfg = Config::load(&config).map_err(|e| format!("{}: {e}", config.display()))?;
    if let Some(url) = store {
        cfg.store.url = Some(url);
    }
    cfg.validate().map_err(|e| e.to_string())?;
    let listen = listen.unwrap_or(cfg.server.listen);
    if cfg.runs_open() {
        tracing::warn!(
            teams = cfg.teams.len(),
            "no API keys configured ([[teams]] api_key_sha256): the gateway runs open, every \
             request is team 'default' (of the [[teams]] entries only one named 'default' applies)"
        );
    }
    let limited: Vec<&str> = cfg
        .teams
        .iter()
        .filter(|t| {
            t.requests_per_minute.is_some()
                || t.tokens_per_minute.is_some()
                || t.max_concurrent.is_some()
        })
        .map(|t| t.name.as_str())
        .collect();
    if !cfg.flow.enabled && !limited.is_empty() {
        tracing::warn!(
            teams = %limited.join(","),
            "flow.enabled = false: team rate limits and max_concurrent are not enforced"
        );
    }
    let store_desc = cfg
        .store
        .url
        .as_deref()
        .map(|u| format!("redis ({})", u.split('@').next_back().unwrap_or(u)))
        .unwrap_or_else(|| "in-memory".into());
    let gateway = Gateway::start(cfg, listen)
        .await
        .map_err(|e| e.to_string())?;
    // Scripts that start the gateway on port 0 read the bound address from this line
    // (tests/python/conftest.py): keep its wording.
    tracing::info!(store = %store_desc, "agentgate listening on {}", gateway.base_url());
    shutdown_signal().await;
    tracing::info!("shutting down");
    gateway.shutdown().await;
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    match cli.command {
        Command::Openapi => {
            print!("{}", agentgate::openapi::yaml());
            ExitCode::SUCCESS
        }
        Command::HashKey { key } => {
            let key = match key.filter(|k| k != "-") {
                Some(key) => key,
                None => {
                    let mut line = String::new();
                    if let Err(e) = std::io::stdin().read_line(&mut line) {
                        eprintln!("agentgate: cannot read the key from standard input: {e}");
                        return ExitCode::FAILURE;
                    }
                    line
                }
            };
            // As a request's bearer token is read: surrounding whitespace is not part of it.
            let key = key.trim().to_string();
            if key.is_empty() {
                eprintln!("agentgate: no key given (as an argument or on standard input)");
                return ExitCode::FAILURE;
            }
            println!("{}", agentgate::auth::hash_key(&key));
            ExitCode::SUCCESS
        }
        Command::Serve {
            config,
            listen,
            store,
        } => {
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("agentgate: cannot start the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match rt.block_on(serve(config, listen, store)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("agentgate: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// `--listen`: an IP address and port; `localhost:PORT` is the IPv4 loopback (the gateway
/// does not resolve names).
fn parse_listen(value: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = value.parse::<SocketAddr>() {
        return Ok(addr);
    }
    if let Some(port) = value.strip_prefix("localhost:") {
        if let Ok(port) = port.parse::<u16>() {
            return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
        }
    }
    Err(format!(
        "`{value}` is not an IP address and port; use one such as 127.0.0.1:8080 (or 0.0.0.0:8080 for every interface)"
    ))
}

#[cfg(test)]
mod tests {
    use super::parse_listen;

    #[test]
    fn listen_takes_an_address_and_port_or_localhost() {
        assert_eq!(parse_listen("0.0.0.0:9").unwrap().to_string(), "0.0.0.0:9");
        assert_eq!(parse_listen("[::1]:9").unwrap().to_string(), "[::1]:9");
        assert_eq!(
            parse_listen("localhost:8081").unwrap().to_string(),
            "127.0.0.1:8081"
        );
        for bad in ["8081", "localhost", "example.com:80", "localhost:x"] {
            assert!(
                parse_listen(bad).unwrap_err().contains("127.0.0.1:8080"),
                "{bad}"
            );
        }
    }
}
