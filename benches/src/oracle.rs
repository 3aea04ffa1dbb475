//! The reuse oracle: the prompt tokens a simulated replica sees for a Responses turn, and the
//! prefix-cache hit ratio an ideal cache would reach on the same requests.
//!
//! [`prompt_tokens`] runs the gateway's translation (`agentgate_adapters`) and the simulator's chat
//! template and tokenizer, so its length equals the `usage.prompt_tokens` a replica reports.
//! [`ReuseOracle`] replays prompts through ONE LRU prefix cache with the simulator's semantics:
//! full blocks of `block_size` tokens with chained hashes; a request's blocks are looked up in
//! order until the first miss (those are its hit tokens, at most the blocks before its last
//! token, which the engines always compute); then all its full blocks are inserted or
//! touched, the tail block least recently used so a prefix is evicted from its end; when over
//! capacity the least recently used blocks go first. With no capacity it never evicts.
//! [`ReuseOracle::observe_with_output`] also caches the blocks of the generated answer, as the
//! simulator does (a benchmark run replays every request that way, [`output_tokens`] giving the
//! answer's tokens); [`reuse_ratio`] replays prompts only.

use std::collections::HashSet;

use agentgate_adapters::{build_chat_request, normalize_input, Flavor, TranslateOptions};
use agentgate_sim::cache::{chain_hashes, KvCache};
use serde_json::Value;

/// Totals of a replay through the oracle.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReuseResult {
    /// Prompt tokens replayed.
    pub prompt_tokens: u64,
    /// Prompt tokens found in the cache (whole blocks).
    pub hit_tokens: u64,
    /// `hit_tokens / prompt_tokens` (0 when nothing was replayed).
    pub ratio: f64,
}

enum Cache {
    /// Bounded LRU: the simulator's own cache model, each request acquired then released.
    Bounded(KvCache),
    /// Unlimited: every block ever stored stays.
    Unlimited(HashSet<u64>),
}

/// An LRU prefix cache fed one prompt at a time, in the order the requests were sent.
pub struct ReuseOracle {
    block_size: usize,
    cache: Cache,
    prompt_tokens: u64,
    hit_tokens: u64,
}

impl ReuseOracle {
    /// A cache of `capacity_blocks` blocks of `block_size` tokens (`None` = unlimited).
    pub fn new(block_size: usize, capacity_blocks: Option<usize>) -> Self {
        let block_size = block_size.max(1);
        let cache = match capacity_blocks {
            Some(capacity) => Cache::Bounded(KvCache::new(block_size, capacity, None)),
            None => Cache::Unlimited(HashSet::new()),
        };
        ReuseOracle {
            block_size,
            cache,
            prompt_tokens: 0,
            hit_tokens: 0,
        }
    }

    /// Replay one prompt; returns its hit tokens.
    pub fn observe(&mut self, prompt: &[u32]) -> usize {
        self.observe_with_output(prompt, &[])
    }

    /// Replay one prompt whose request generated `output` tokens: the lookup uses the prompt,
    /// and the full blocks of prompt + output are cached (the simulator also caches generated
    /// blocks, so a next turn that repeats the answer hits through it). Returns the hit tokens.
    pub fn observe_with_output(&mut self, prompt: &[u32], output: &[u32]) -> usize {
        let hashes = chain_hashes(prompt, self.block_size);
        // As the engines: the last prompt token is always computed, so at most the blocks
        // before it hit.
        let hit_limit = prompt.len().saturating_sub(1) / self.block_size.max(1);
        let hit_blocks = self
            .lookup_and_store(prompt, &hashes, output)
            .min(hit_limit);
        let hit_tokens = (hit_blocks * self.block_size).min(prompt.len());
        self.prompt_tokens += prompt.len() as u64;
        self.hit_tokens += hit_tokens as u64;
        hit_tokens
    }

    /// Leading cached blocks of `hashes`, then cache the blocks of `prompt` + `output`.
    fn lookup_and_store(&mut self, prompt: &[u32], hashes: &[u64], output: &[u32]) -> usize {
        let (stored_tokens, stored_hashes);
        let (tokens, all_hashes): (&[u32], &[u64]) = if output.is_empty() {
            (prompt, hashes)
        } else {
            stored_tokens = [prompt, output].concat();
            stored_hashes = chain_hashes(&stored_tokens, self.block_size);
            (&stored_tokens, &stored_hashes)
        };
        match &mut self.cache {
            Cache::Bounded(cache) => {
                let hit_blocks = cache.cached_prefix_blocks(hashes);
                // A sequence larger than the whole cache cannot be held; it only looks up.
                if cache.acquire(all_hashes, tokens, 0).is_some() {
                    cache.release(all_hashes, 0);
                }
                hit_blocks
            }
            Cache::Unlimited(stored) => {
                let hit_blocks = hashes.iter().take_while(|h| stored.contains(h)).count();
                stored.extend(all_hashes.iter().skip(hit_blocks).copied());
                hit_blocks
            }
        }
    }

    /// Distinct blocks an unlimited oracle holds (every full block it was ever given); None for
    /// a bounded one.
    pub fn distinct_blocks(&self) -> Option<u64> {
        match &self.cache {
            Cache::Unlimited(stored) => Some(stored.len() as u64),
            Cache::Bounded(_) => None,
        }
    }

    /// Totals so far.
    pub fn result(&self) -> ReuseResult {
        ReuseResult {
            prompt_tokens: self.prompt_tokens,
            hit_tokens: self.hit_tokens,
            ratio: if self.prompt_tokens == 0 {
                0.0
            } else {
                self.hit_tokens as f64 / self.prompt_tokens as f64
            },
        }
    }
}

/// Hit ratio of ONE LRU prefix cache of `capacity_blocks` (None = unlimited) replaying `prompts`
/// (each a prompt's token ids, in the order the requests were sent); full blocks of `block_size`
/// tokens, chained hashes, like the simulator.
pub fn reuse_ratio(
    prompts: &[Vec<u32>],
    block_size: usize,
    capacity_blocks: Option<usize>,
) -> ReuseResult {
    let mut oracle = ReuseOracle::new(block_size, capacity_blocks);
    for prompt in prompts {
        oracle.observe(prompt);
    }
    oracle.result()
}

/// The exact token ids the simulator sees for a Responses turn: adapters' translation + the sim's
/// chat template + tokenizer.
///
/// `request_body` is the Responses request (its `instructions`, `tools`, ...; `input` is ignored),
/// `history` the items of earlier turns (inputs and outputs, as `previous_response_id` resolves
/// them) and `input_items` this turn's input items. A request the gateway would reject (e.g. an
/// non-string `instructions`) yields no tokens.
pub fn prompt_tokens(request_body: &Value, history: &[Value], input_items: &[Value]) -> Vec<u32> {
    let normalize = |items: &[Value]| {
        normalize_input(&Value::Array(items.to_vec())).unwrap_or_else(|_| items.to_vec())
    };
    let (history, input) = (normalize(history), normalize(input_items));
    let Ok(plan) = build_chat_request(
        request_body,
        &history,
        &input,
        &TranslateOptions::new(Flavor::Vllm),
    ) else {
        return Vec::new();
    };
    let messages = plan
        .body
        .get("messages")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let tools = plan
        .body
        .get("tools")
        .and_then(Value::as_array)
        .map(Vec::as_slice);
    // Rendered as the simulated vLLM renders it, reasoning under vLLM's name.
    agentgate_sim::tokenizer::tokenize(&agentgate_sim::template::render_chat(
        messages,
        tools,
        "reasoning",
    ))
}

/// The tokens a simulated engine generated for a request whose prompt was `prompt` (from
/// [`prompt_tokens`] of the same `request_body`, `history` and `input_items`) and whose answer
/// came back as the Response `output` items: what the chat template renders for that answer
/// when it comes back in the history, which the simulator generates token for token (and
/// caches). Empty when the answer does not render after the prompt that way.
pub fn output_tokens(
    request_body: &Value,
    history: &[Value],
    input_items: &[Value],
    output: &[Value],
    prompt: &[u32],
) -> Vec<u32> {
    if output.is_empty() || prompt.is_empty() {
        return Vec::new();
    }
    let answered: Vec<Value> = input_items.iter().chain(output).cloned().collect();
    let with_answer = prompt_tokens(request_body, history, &answered);
    // The answer is followed by its end and the next generation prompt.
    let after = agentgate_sim::tokenizer::tokenize("<|im_end|>\n<|im_start|>assistant\n");
    match with_answer
        .strip_prefix(prompt)
        .and_then(|rest| rest.strip_suffix(after.as_slice()))
    {
        Some(answer) => answer.to_vec(),
        None => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A prompt of `blocks` full blocks of 4 tokens (plus `tail` extra tokens) from `seed`.
    fn prompt(seed: u32, blocks: usize, tail: usize) -> Vec<u32> {
        (0..(blocks * 4 + tail) as u32)
            .map(|i| seed * 10_000 + i)
            .collect()
    }

    #[test]
    fn hits_are_the_leading_cached_full_blocks() {
        let a = prompt(1, 3, 2);
        let mut longer = a.clone();
        longer.truncate(12);
        longer.extend(prompt(2, 2, 0));
        let result = reuse_ratio(&[a.clone(), a.clone(), longer], 4, Some(100));
        // a: 14 tokens, no hit; a again: 3 blocks = 12 hit; longer (20 tokens) shares 3 blocks.
        assert_eq!(result.prompt_tokens, 14 + 14 + 20);
        assert_eq!(result.hit_tokens, 12 + 12);
        assert!((result.ratio - 24.0 / 48.0).abs() < 1e-12);
        // A different first block breaks the chain even when later tokens are equal.
        let mut changed = a.clone();
        changed[0] = 7;
        assert_eq!(reuse_ratio(&[a, changed], 4, None).hit_tokens, 0);
        assert_eq!(reuse_ratio(&[], 4, None).ratio, 0.0);
        // The last token is always computed: a block-aligned prompt seen before hits all but
        // its last block.
        let aligned = prompt(5, 2, 0);
        assert_eq!(
            reuse_ratio(&[aligned.clone(), aligned], 4, None).hit_tokens,
            4
        );
    }

    #[test]
    fn a_prompt_larger_than_the_cache_only_looks_up() {
        let mut oracle = ReuseOracle::new(4, Some(2));
        let a = prompt(1, 3, 0);
        oracle.observe(&a);
        assert_eq!(
            oracle.observe(&a),
            0,
            "3 blocks never fit in 2: nothing was stored"
        );
        let b = prompt(2, 2, 1);
        oracle.observe(&b);
        assert_eq!(oracle.observe(&b), 8);
        assert_eq!(oracle.result().prompt_tokens, 12 + 12 + 9 + 9);
    }

    #[test]
    fn eviction_is_least_recently_used_first() {
        let (a, b, c) = (prompt(1, 2, 1), prompt(2, 2, 1), prompt(3, 2, 1));
        let mut oracle = ReuseOracle::new(4, Some(4));
        oracle.observe(&a);
        oracle.observe(&b);
        assert_eq!(
            oracle.observe(&a),
            8,
            "touch a: b is now least recently used"
        );
        oracle.observe(&c);
        assert_eq!(oracle.observe(&a), 8, "a survived");
        assert_eq!(oracle.observe(&b), 0, "b was evicted");
        // Now b and a are cached, a least recently used; one new block evicts a's tail block
        // only (a prompt's tail is older than its head), so a's first block still hits.
        let d = prompt(4, 1, 0);
        oracle.observe(&d);
        assert_eq!(oracle.observe(&a), 4, "only a's tail block was evicted");
    }

    #[test]
    fn generated_blocks_are_cached_for_the_next_turn() {
        let first = prompt(1, 2, 0);
        let answer = prompt(9, 2, 0);
        let next = [first.clone(), answer.clone(), prompt(3, 1, 0)].concat();
        for capacity in [None, Some(100)] {
            let mut oracle = ReuseOracle::new(4, capacity);
            oracle.observe_with_output(&first, &answer);
            assert_eq!(oracle.observe(&next), 16, "hits through the answer");
            let mut prompts_only = ReuseOracle::new(4, capacity);
            prompts_only.observe(&first);
            assert_eq!(prompts_only.observe(&next), 8);
        }
    }

    #[test]
    fn unlimited_capacity_never_evicts() {
        let prompts: Vec<Vec<u32>> = (0..50).map(|seed| prompt(seed, 8, 3)).collect();
        let mut replay = prompts.clone();
        replay.extend(prompts.iter().cloned());
        let unlimited = reuse_ratio(&replay, 4, None);
        assert_eq!(unlimited.hit_tokens, 50 * 32);
        let small = reuse_ratio(&replay, 4, Some(40));
        assert_eq!(
            small.hit_tokens, 0,
            "a cyclic replay larger than an LRU cache never hits"
        );
        let fits = reuse_ratio(&replay, 4, Some(400));
        assert_eq!(fits, unlimited);
    }

    #[test]
    fn prompt_tokens_follow_the_template() {
        let body = json!({"model": "m", "instructions": "be brief"});
        let input = vec![json!({"role": "user", "content": "hello there"})];
        let tokens = prompt_tokens(&body, &[], &input);
        let expected = agentgate_sim::tokenizer::tokenize(&agentgate_sim::template::render_chat(
            &[
                json!({"role": "system", "content": "be brief"}),
                json!({"role": "user", "content": "hello there"}),
            ],
            None,
            "reasoning",
        ));
        assert_eq!(tokens, expected);
        let rejected = json!({"model": "m", "instructions": 5});
        assert!(prompt_tokens(&rejected, &[], &input).is_empty());
    }

    /// A conversation with tools, a function call and its output, as the runner would send it.
    fn tool_conversation() -> (Value, Vec<Value>, Vec<Value>) {
        let body = json!({
            "model": "sim-model",
            "instructions": "you are a careful coding agent",
            "tools": [{"type": "function", "name": "read_file", "description": "read one file",
                       "parameters": {"type": "object", "properties": {"target": {"type": "string"}},
                                      "required": ["target"]}}],
            "tool_choice": "auto",
            "max_output_tokens": 16,
        });
        let history = vec![
            json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "please read_file the main module"}]}),
            json!({"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": "{\"target\":\"main\"}"}),
            json!({"type": "function_call_output", "call_id": "call_1", "output": "fn main first line of the file"}),
            json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "The file looks fine."}]}),
        ];
        let input = vec![json!({"role": "user", "content": "now list the tests"})];
        (body, history, input)
    }

    #[tokio::test]
    async fn prompt_tokens_match_the_simulator_usage() {
        let config = agentgate_sim::SimConfig {
            listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            time_scale: 0.0,
            ..Default::default()
        };
        let sim = agentgate_sim::spawn(config)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let (body, history, input) = tool_conversation();
        let expected = prompt_tokens(&body, &history, &input).len();
        assert!(expected > 40);
        let plan = build_chat_request(
            &body,
            &normalize_input(&Value::Array(history.clone())).unwrap_or_default(),
            &normalize_input(&Value::Array(input.clone())).unwrap_or_default(),
            &TranslateOptions::new(Flavor::Vllm),
        )
        .unwrap_or_else(|e| panic!("{e:?}"));
        let mut chat = plan.body;
        chat["stream"] = json!(false);
        chat["model"] = json!("sim-model");
        if let Some(map) = chat.as_object_mut() {
            map.remove("stream_options");
        }
        let response: Value = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", sim.base_url()))
            .json(&chat)
            .send()
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .json()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        sim.shutdown().await;
        assert_eq!(
            response["usage"]["prompt_tokens"].as_u64(),
            Some(expected as u64),
            "{response}"
        );
    }
}
