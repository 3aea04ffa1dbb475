//! Feeds the reuse oracles while the replay runs, on one background thread (so tokenizing long
//! prompts never occupies more than one core, and never the async workers that run the gateway
//! and the replicas). Requests are reported in completion order and replayed in send order: a
//! small reorder buffer holds prompts that finished before earlier requests, so no prompt is kept
//! once the requests sent before it have finished. Besides the totals, it keeps what the oracle
//! with the fleet's capacity saw for each request ([`OracleHit`]), so figures over a time window
//! (see `run::kill`) can be set against what an ideal cache would have served in that window.
//! Optionally a third oracle has a smaller capacity (the fleet left after a replica is killed):
//! by LRU's stack property (an LRU cache of C blocks holds the C most recently used blocks,
//! whatever its earlier size), from the kill on it holds exactly what the pooled cache would hold
//! had it lost that capacity at the kill.

use std::collections::BTreeMap;
use std::sync::mpsc;

use serde_json::Value;

use crate::oracle::{self, ReuseOracle, ReuseResult};

/// What the replay reports for one request.
#[derive(Debug)]
pub enum ReuseJob {
    /// A successful request: the body sent, the history the gateway resolved (chained), and the
    /// new input items (for a request without `previous_response_id`, `history` is empty and
    /// `items` is the whole input).
    Served {
        /// Send order.
        seq: u64,
        /// The request body (instructions, tools).
        body: Value,
        /// Items of earlier turns resolved by the gateway.
        history: Vec<Value>,
        /// This request's input items.
        items: Vec<Value>,
        /// The response's output items (the answer the engine generated and cached).
        output: Vec<Value>,
    },
    /// A request that failed or was shed (it reached no engine cache).
    Failed {
        /// Send order.
        seq: u64,
    },
}

impl ReuseJob {
    fn seq(&self) -> u64 {
        match self {
            ReuseJob::Served { seq, .. } | ReuseJob::Failed { seq } => *seq,
        }
    }
}

/// What the oracle with the fleet's capacity saw for one served request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OracleHit {
    /// Send order of the request.
    pub seq: u64,
    /// Its prompt tokens.
    pub prompt_tokens: u64,
    /// Those the oracle found cached.
    pub hit_tokens: u64,
    /// Those the smaller oracle found cached, when there is one.
    pub survivor_hit_tokens: Option<u64>,
}

/// Everything the oracles computed.
#[derive(Debug, Clone, PartialEq)]
pub struct ReuseOutcome {
    /// One LRU cache with the fleet's capacity.
    pub available: ReuseResult,
    /// One cache of unlimited capacity.
    pub infinite: ReuseResult,
    /// Per served request, in send order: the fleet-capacity oracle's view.
    pub per_request: Vec<OracleHit>,
    /// Distinct full blocks of every served request's prompt and answer (the unlimited oracle's
    /// contents).
    pub distinct_prompt_blocks: u64,
}

/// The oracles' thread: one with the fleet's capacity, one unlimited.
pub struct ReuseFeed {
    sender: mpsc::Sender<ReuseJob>,
    worker: std::thread::JoinHandle<ReuseOutcome>,
}

/// Token ids of a served request's prompt and of its answer.
type Served = (Vec<u32>, Vec<u32>);

/// [`Served`] tokens of a request (`None` for a failed one).
fn tokens_of(job: ReuseJob) -> Option<Served> {
    match job {
        ReuseJob::Served {
            body,
            history,
            items,
            output,
            ..
        } => {
            let prompt = oracle::prompt_tokens(&body, &history, &items);
            let answer = oracle::output_tokens(&body, &history, &items, &output, &prompt);
            Some((prompt, answer))
        }
        ReuseJob::Failed { .. } => None,
    }
}

impl ReuseFeed {
    /// Start the thread: oracles of `capacity_blocks` and of unlimited capacity, and one of
    /// `survivor_blocks` if given; `block_size` tokens a block.
    pub fn start(
        block_size: usize,
        capacity_blocks: usize,
        survivor_blocks: Option<usize>,
    ) -> std::io::Result<ReuseFeed> {
        let (sender, jobs) = mpsc::channel::<ReuseJob>();
        let worker = std::thread::Builder::new()
            .name("reuse-oracle".into())
            .spawn(move || {
                let mut available = ReuseOracle::new(block_size, Some(capacity_blocks));
                let mut infinite = ReuseOracle::new(block_size, None);
                let mut survivors =
                    survivor_blocks.map(|blocks| ReuseOracle::new(block_size, Some(blocks)));
                let mut next_seq = 0u64;
                let mut pending: BTreeMap<u64, Option<Served>> = BTreeMap::new();
                let mut per_request = Vec::new();
                // Each prompt looks up, then its blocks and its answer's are cached, as the
                // engines cache them.
                let mut observe = |seq: u64, tokens: Option<Served>| {
                    if let Some((prompt, answer)) = tokens {
                        let hit = available.observe_with_output(&prompt, &answer);
                        infinite.observe_with_output(&prompt, &answer);
                        let survivor_hit = survivors
                            .as_mut()
                            .map(|o| o.observe_with_output(&prompt, &answer) as u64);
                        per_request.push(OracleHit {
                            seq,
                            prompt_tokens: prompt.len() as u64,
                            hit_tokens: hit as u64,
                            survivor_hit_tokens: survivor_hit,
                        });
                    }
                };
                for job in jobs {
                    let seq = job.seq();
                    pending.insert(seq, tokens_of(job));
                    while let Some(prompt) = pending.remove(&next_seq) {
                        observe(next_seq, prompt);
                        next_seq += 1;
                    }
                }
                // Sequence numbers that were never reported leave gaps: replay the rest in order.
                for (seq, prompt) in std::mem::take(&mut pending) {
                    observe(seq, prompt);
                }
                ReuseOutcome {
                    available: available.result(),
                    infinite: infinite.result(),
                    per_request,
                    distinct_prompt_blocks: infinite.distinct_blocks().unwrap_or(0),
                }
            })?;
        Ok(ReuseFeed { sender, worker })
    }

    /// A handle for reporting requests.
    pub fn sender(&self) -> mpsc::Sender<ReuseJob> {
        self.sender.clone()
    }

    /// Wait until every reported request is replayed. Blocking; every other sender must have
    /// been dropped.
    pub fn finish(self) -> Result<ReuseOutcome, String> {
        drop(self.sender);
        self.worker
            .join()
            .map_err(|_| "the reuse oracle thread panicked".to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prompts_are_replayed_in_send_order_whatever_the_completion_order() {
        let body = json!({"model": "m", "instructions": "you are a careful coding agent"});
        let first = vec![json!({"type": "message", "role": "user", "content": "list the files"})];
        let reply = json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]});
        let mut second = first.clone();
        second.push(reply.clone());
        second.push(json!({"type": "message", "role": "user", "content": "now read them"}));
        // The survivor oracle is too small for the first prompt: it never hits.
        let feed = ReuseFeed::start(4, 1000, Some(1)).unwrap();
        let sender = feed.sender();
        // Sent: 0 = first, 1 = failed, 2 = second (extends first). Completed: 2, 1, 0.
        for job in [
            ReuseJob::Served {
                seq: 2,
                body: body.clone(),
                history: Vec::new(),
                items: second.clone(),
                output: Vec::new(),
            },
            ReuseJob::Failed { seq: 1 },
            ReuseJob::Served {
                seq: 0,
                body: body.clone(),
                history: Vec::new(),
                items: first.clone(),
                output: vec![reply.clone()],
            },
        ] {
            sender.send(job).unwrap();
        }
        drop(sender);
        let outcome = feed.finish().unwrap();
        let (available, infinite) = (outcome.available, outcome.infinite);
        let first_prompt = oracle::prompt_tokens(&body, &[], &first);
        let first_len = first_prompt.len() as u64;
        let answer_len = oracle::output_tokens(
            &body,
            &[],
            &first,
            std::slice::from_ref(&reply),
            &first_prompt,
        )
        .len() as u64;
        assert!(answer_len > 0);
        let second_len = oracle::prompt_tokens(&body, &[], &second).len() as u64;
        assert_eq!(available.prompt_tokens, first_len + second_len);
        assert_eq!(
            available.hit_tokens,
            (first_len + answer_len) / 4 * 4,
            "the second prompt reuses the first one's full blocks, its answer's included"
        );
        assert_eq!(infinite.hit_tokens, available.hit_tokens);
        assert_eq!(
            outcome.distinct_prompt_blocks,
            second_len / 4,
            "the second prompt's full blocks include the first one's"
        );
        assert_eq!(
            outcome.per_request,
            [
                OracleHit {
                    seq: 0,
                    prompt_tokens: first_len,
                    hit_tokens: 0,
                    survivor_hit_tokens: Some(0),
                },
                OracleHit {
                    seq: 2,
                    prompt_tokens: second_len,
                    hit_tokens: (first_len + answer_len) / 4 * 4,
                    survivor_hit_tokens: Some(0),
                },
            ],
            "per request, in send order, failed ones left out"
        );
    }
}
