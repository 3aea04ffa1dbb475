//! `agentgate-bench`: command-line entry point; one subcommand per benchmark.

mod duration;
mod load;
mod overhead;
mod procs;
mod sim_throughput;
mod stats;

use clap::{Parser, Subcommand};

/// Benchmarks for agentgate and its engine simulator.
#[derive(Debug, Parser)]
#[command(name = "agentgate-bench", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The available benchmarks.
#[derive(Debug, Subcommand)]
enum Command {
    /// Requests per second one simulator sustains for small non-streaming chat completions.
    SimThroughput(sim_throughput::Args),
    /// Latency, throughput and CPU the gateway adds over calling the engine directly, per
    /// (concurrency, prompt size) cell.
    Overhead(overhead::Args),
    /// Replay a workload against the gateway once per routing policy and compare cache reuse,
    /// latency and engine work (summary.json, report.md, SVG charts).
    Run(Box<agentgate_bench::run::Args>),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // `run --clock virtual`: one thread on a paused clock that jumps to the next timer whenever
    // every task waits (see agentgate_bench::run::clock; each row seeds its random choices).
    let virtual_clock = matches!(&cli.command,
        Command::Run(args) if args.clock() == agentgate_bench::run::ClockMode::Virtual);
    let built = if virtual_clock {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
    };
    let runtime = match built {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::SimThroughput(args) => sim_throughput::run(args).await,
            Command::Overhead(args) => overhead::run(args).await,
            Command::Run(args) => agentgate_bench::run::run(*args).await,
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            std::process::ExitCode::FAILURE
        }
    }
}
