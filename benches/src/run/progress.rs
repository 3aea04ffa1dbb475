//! The progress line on stderr while a policy runs: requests done, errors, shed, in flight and
//! elapsed wall time, rewritten in place with `\r`.

use std::io::Write;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::replay::Counters;

/// A background task redrawing the progress line until [`Progress::finish`].
pub struct Progress {
    counters: Arc<Counters>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// One progress line.
pub fn line(policy: &str, counters: &Counters, elapsed: Duration) -> String {
    format!(
        "\r[{policy}] {} requests done ({} errors, {} shed), {} in flight, {:.1}s elapsed   ",
        counters.done.load(Ordering::Relaxed),
        counters.errors.load(Ordering::Relaxed),
        counters.shed.load(Ordering::Relaxed),
        counters.in_flight.load(Ordering::Relaxed),
        elapsed.as_secs_f64(),
    )
}

impl Progress {
    /// Start redrawing every quarter second (`visible = false` only counts).
    pub fn start(policy: &str, visible: bool) -> Progress {
        let counters = Arc::new(Counters::default());
        if !visible {
            return Progress {
                counters,
                stop: None,
                task: None,
            };
        }
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let policy = policy.to_string();
        let shown = Arc::clone(&counters);
        let task = tokio::spawn(async move {
            let started = Instant::now();
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            loop {
                let done = tokio::select! {
                    _ = &mut stopped => true,
                    _ = tick.tick() => false,
                };
                let mut stderr = std::io::stderr().lock();
                let _ = stderr.write_all(line(&policy, &shown, started.elapsed()).as_bytes());
                if done {
                    let _ = stderr.write_all(b"\n");
                }
                let _ = stderr.flush();
                if done {
                    break;
                }
            }
        });
        Progress {
            counters,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// The counters the replay updates.
    pub fn counters(&self) -> Arc<Counters> {
        Arc::clone(&self.counters)
    }

    /// Draw the final line and end it with a newline.
    pub async fn finish(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_shows_counts_and_elapsed_time() {
        let counters = Counters::default();
        counters.done.store(12, Ordering::Relaxed);
        counters.shed.store(2, Ordering::Relaxed);
        let text = line("least_loaded", &counters, Duration::from_millis(1500));
        assert!(text.starts_with("\r[least_loaded] 12 requests done (0 errors, 2 shed)"));
        assert!(text.contains("1.5s elapsed"));
    }
}
