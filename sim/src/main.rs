//! The `agentgate-sim` binary: parse the flags, start one replica, serve until Ctrl-C.

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let config = agentgate_sim::SimConfig::parse();
    let flavor = config.flavor;
    let role = config.role;
    let handle = match agentgate_sim::spawn(config).await {
        Ok(handle) => handle,
        Err(error) => {
            tracing::error!(%error, "cannot start the simulator; check --listen and the other flags");
            return std::process::ExitCode::FAILURE;
        }
    };
    tracing::info!(url = %handle.base_url(), ?flavor, ?role, "agentgate-sim serving");
    if let Err(error) = tokio::signal::ctrl_c().await {
        tracing::error!(%error, "cannot wait for Ctrl-C");
    }
    handle.shutdown().await;
    std::process::ExitCode::SUCCESS
}
