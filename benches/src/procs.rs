//! Child processes for benchmarks: find sibling binaries, pick free ports, start a server and
//! wait until it answers, and kill it when the guard drops.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Kills the child process when dropped.
pub struct ChildGuard(pub Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A binary built next to this executable (target/<profile>/NAME).
pub fn sibling_binary(name: &str) -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot locate this executable: {e}"))?;
    let dir = exe.parent().unwrap_or(Path::new("."));
    let candidate = dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    if candidate.is_file() {
        Ok(candidate)
    } else {
        Err(format!(
            "{} not found; build it with `cargo build --release -p agentgate -p agentgate-sim -p agentgate-bench`",
            candidate.display()
        ))
    }
}

/// A port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .map_err(|e| format!("cannot find a free port on 127.0.0.1: {e}"))
}

/// Start `binary args...` and poll `ready_url` until it answers 2xx (bounded attempts).
pub async fn start_server(
    binary: &Path,
    args: &[String],
    ready_url: &str,
) -> Result<ChildGuard, String> {
    let child = Command::new(binary)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", binary.display()))?;
    let mut guard = ChildGuard(child);
    let client = reqwest::Client::new();
    let mut last = String::new();
    for _ in 0..400 {
        if let Ok(Some(status)) = guard.0.try_wait() {
            return Err(format!(
                "{} exited before serving ({status})",
                binary.display()
            ));
        }
        match client.get(ready_url).send().await {
            Ok(r) if r.status().is_success() => return Ok(guard),
            Ok(r) => last = format!("HTTP {}", r.status()),
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(format!("{ready_url} did not become ready (last: {last})"))
}

/// Poll `ready_url` until it answers 2xx (bounded attempts), for servers this process did not
/// start (a `--target`, or an in-process simulator).
pub async fn wait_ready(ready_url: &str) -> Result<(), String> {
    let client = reqwest::Client::new();
    let mut last = String::new();
    for _ in 0..400 {
        match client.get(ready_url).send().await {
            Ok(r) if r.status().is_success() => return Ok(()),
            Ok(r) => last = format!("HTTP {}", r.status()),
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(format!("{ready_url} did not become ready (last: {last})"))
}
