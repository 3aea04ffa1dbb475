//! Engine protocols for agentgate: translates OpenAI Responses API requests into Chat Completions
//! bodies for vLLM / SGLang / generic OpenAI-compatible engines, synthesizes Responses streaming
//! events from the engines' chat chunks, and talks to engines over HTTP.
//!
//! Request path: [`normalize_input`] -> [`build_chat_request`] -> [`EngineClient::chat_stream`]
//! -> [`ResponseStream::on_chunk`] for every chunk -> [`ResponseStream::finish`] (or `fail`).

mod client;
pub mod compaction;
pub mod disagg;
pub mod engine_metrics;
mod error;
mod ids;
mod input;
mod prompt_text;
mod reasoning_blob;
mod request;
pub mod sse;
mod stream;
mod tools;

pub use client::{estimate_prompt_tokens, root_url, ChunkStream, ClientOptions, EngineClient};
pub use compaction::CompactionOptions;
pub use disagg::{DisaggError, Disaggregated, PrefillTarget, PrefillUsage};
pub use engine_metrics::{parse_metrics, EngineMetrics};
pub use error::{context_window_in, ApiError, OneLine, UpstreamError};
pub use ids::{new_item_id, output_item_id, push_random_hex, response_of_item};
pub use input::normalize_input;
pub use prompt_text::prompt_text;
pub use reasoning_blob::{decode_reasoning_blob, encode_reasoning_blob};
pub use request::{
    build_chat_request, includes_encrypted_reasoning, instruction_media, ChatPlan,
    HostedToolPolicy, TranslateOptions, REASONING_EFFORTS,
};
pub use stream::{
    carries_output, context_overflow_in_chunk, failure_without_output, ResponseStream, SseEvent,
};
pub use tools::{ToolName, ToolNameMap};

/// Which engine dialect of Chat Completions an endpoint speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Flavor {
    /// vLLM's OpenAI-compatible server.
    Vllm,
    /// SGLang's OpenAI-compatible server.
    Sglang,
    /// Any other OpenAI-compatible Chat Completions server (including api.openai.com).
    Openai,
}

impl Flavor {
    /// True for the self-hosted engines (vLLM, SGLang) that accept engine-specific extensions.
    pub fn is_self_hosted(self) -> bool {
        matches!(self, Flavor::Vllm | Flavor::Sglang)
    }
}
