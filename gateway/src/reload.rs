//! Hot reload of the flow-control sections: `[[bands]]`, `[[teams]]` (API keys included) and
//! `[flow]`.
//!
//! The config file is polled every `server.reload_interval_ms` for a change of modification
//! time, length, inode or status-change time (as the endpoints-file watcher does), against the
//! file as it was when the running configuration was read. A change is read once the file has
//! kept the same stamp for a whole poll (and again if it changed while it was read), so a file
//! written in place is read whole; a changed file that cannot be read yet is tried again at
//! every poll. A changed file is read and validated whole; if it is valid, every pool's flow
//! controller is reconfigured (queued requests stay queued, in arrival order, with their
//! deadlines; see `FlowController::reconfigure`) and the key ring replaced. A file that does
//! not parse or validate changes nothing: the reason is logged and
//! `agentgate_config_reloads_total{result="error"}` counts it. Other sections, and `[flow]
//! exchange_interval_ms` (the exchange task's period), take effect at the next start: a reload
//! of a file whose other sections differ from the running ones (say a pool's `endpoints`)
//! applies the flow sections, warns naming the others and counts `result="restart_needed"`,
//! until the file matches again or the gateway restarts. Endpoints that come and go belong in a
//! pool's watched `endpoints_file`.
//! Replace the file atomically (write, then rename).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::app::AppState;
use crate::config::{Config, FileStamp};

/// Apply `config`'s `[[bands]]`, `[[teams]]` and `[flow]` to a running gateway: flow
/// controllers first, then the key ring. On error nothing changes. A configuration without
/// API keys is refused while the gateway has some: it would let every client in as the open
/// team, which takes a restart on purpose, not an edit that lost the keys.
pub fn apply(state: &AppState, config: &Config) -> Result<(), String> {
    if config.runs_open() && !state.keys.is_open() {
        return Err(
            "it lists no API keys (api_key_sha256), so it would open the gateway to every \
             client; restart the gateway to run it open"
                .into(),
        );
    }
    state.flow.reconfigure(config)?;
    state.keys.replace(&config.teams);
    Ok(())
}

/// Apply `text`, read from `path` when it had `stamp`; the outcome is logged and counted. A
/// file whose sections only a restart applies differ from the running ones is applied, with a
/// warning naming them, and counted `result="restart_needed"`.
fn reload(state: &AppState, path: &Path, text: &str, stamp: Option<FileStamp>) {
    let outcome = Config::from_file_text(path, text, stamp)
        .map_err(|e| e.to_string())
        .and_then(|config| apply(state, &config).map(|()| config));
    match outcome {
        Ok(config) => {
            let changed =
                changed_sections(&state.config.restart_sections, &config.restart_sections);
            tracing::info!(
                file = %path.display(),
                bands = config.flow_bands().len(),
                teams = config.teams.len(),
                flow = config.flow.enabled,
                "config reloaded: [[bands]], [[teams]] and [flow] applied"
            );
            if changed.is_empty() {
                state.metrics.config_reloads.inc(["ok"]);
            } else {
                state.metrics.config_reloads.inc(["restart_needed"]);
                tracing::warn!(
                    file = %path.display(),
                    "config settings read at start only changed ({}): a reload applies [[bands]], [[teams]] and [flow] (but for flow.exchange_interval_ms); restart the gateway to apply the others",
                    changed.join(", ")
                );
            }
        }
        Err(reason) => {
            state.metrics.config_reloads.inc(["error"]);
            tracing::warn!(file = %path.display(), "config not reloaded, keeping the current one: {reason}");
        }
    }
}

/// The top-level sections (and `flow.exchange_interval_ms`) that differ between `before` and
/// `after`, as `[name]`.
fn changed_sections(before: &toml::Table, after: &toml::Table) -> Vec<String> {
    let mut names: Vec<&String> = before.keys().chain(after.keys()).collect();
    names.sort();
    names.dedup();
    names
        .into_iter()
        .filter(|name| before.get(*name) != after.get(*name))
        .map(|name| format!("[{name}]"))
        .collect()
}

/// The task watching the config file.
pub struct ConfigWatcher {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl ConfigWatcher {
    /// Watch the file `state.config` was loaded from, unless it was not loaded from a file or
    /// `server.reload_interval_ms` is 0.
    pub fn start(state: &Arc<AppState>) -> Option<ConfigWatcher> {
        let path = state.config.source.clone()?;
        let every = Duration::from_millis(state.config.server.reload_interval_ms);
        if every.is_zero() {
            return None;
        }
        let (stop, rx) = watch::channel(false);
        // The baseline is the file as it was when the running configuration was read: a change
        // made since (while the gateway started) is then still a change.
        let seen = state.config.source_stamp;
        let task = tokio::spawn(watch_loop(state.clone(), path, seen, every, rx));
        Some(ConfigWatcher { stop, task })
    }

    /// Stop watching.
    pub async fn shutdown(self) {
        self.stop.send_replace(true);
        let _ = self.task.await;
    }
}

async fn watch_loop(
    state: Arc<AppState>,
    path: PathBuf,
    mut seen: Option<FileStamp>,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let mut unreadable = None;
    let mut settling = None;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let now = FileStamp::of(&path);
        if now == seen {
            continue;
        }
        // A change is read once the file has kept its stamp for a whole poll: by then a writer
        // that truncates and writes in place is done (a file cut after a `[[teams]]` entry
        // still parses, and would remove the teams after it).
        if settling != Some(now) {
            settling = Some(now);
            continue;
        }
        if now.is_none() {
            seen = now;
            tracing::warn!(file = %path.display(), "config file is missing; keeping the current configuration");
            continue;
        }
        // A file that cannot be read for now (no permission yet, out of file descriptors)
        // is tried again at every poll, with one warning, until it can.
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) => {
                if unreadable != Some(e.kind()) {
                    unreadable = Some(e.kind());
                    tracing::warn!(file = %path.display(), "cannot read the changed config file ({e}); keeping the current configuration and trying again");
                }
                continue;
            }
        };
        unreadable = None;
        let after = FileStamp::of(&path);
        if after != now {
            // Written to while it was read: read it once it settles.
            settling = Some(after);
            continue;
        }
        seen = now;
        reload(&state, &path, &text, now);
    }
}
