//! agentgate's scheduler: when a request is admitted and which endpoint serves it.
//!
//! Admission is [`flow`] control: the [`FlowController`] orders waiting work by priority
//! band, fairly across teams within a band (weighted fair queuing over tokens), continuing
//! turns before new sessions within a team, and sheds, times out or rate-limits what cannot be
//! served (formulas in its module doc).
//!
//! Picking is a pipeline, as in llm-d's router: **filters** narrow the pool to the endpoints
//! that may take the request, weighted **scorers** rate each one in [0, 1], and the highest
//! total wins, random among ties. The pick says why ([`Reason`]: `pin`, `prefix`, `load`, or
//! `round_robin` for that policy), how
//! much of the prompt the engine will probably have to prefill, and what became of the
//! session's pin ([`PinOutcome`]).
//!
//! - [`endpoint`]: one engine replica and the gateway's live view of it: health, the last
//!   scraped load report, and its own exact counts of in-flight requests, prompt tokens and
//!   pending prefill tokens (RAII guards); [`Saturation`] limits;
//! - [`picker`]: the [`Picker`] trait, [`PickRequest`] and [`Pick`], and the baselines
//!   [`RoundRobin`] and [`LeastLoaded`];
//! - [`filter`]: the [`Filter`] trait and the filters (available, not excluded, role,
//!   prefer unsaturated, prefer a free slot, spread new sessions of bands with a reserve);
//! - [`scorer`]: the [`Scorer`] trait and the scorers `session_pin`, `prefix` (with the
//!   anti-herding gate), `queue`, `kv_usage`, `in_flight_tokens` (in time, by measured prefill
//!   throughput, once every candidate has one), with their formulas;
//! - [`pin`]: sticky until saturated: when a session's pin breaks, in tokens of prefill work
//!   (wait on the pinned endpoint against the cost of recomputing the prefix elsewhere);
//! - [`pipeline`]: the [`Pipeline`] picker that composes them from a [`ScoringConfig`]
//!   (weights by scorer name), how it attributes the reason, and the default weights;
//! - [`policy`]: the policy names the configuration accepts (`round_robin`, `least_loaded`,
//!   `prefix` = prefix and load scorers, `session` = the full pipeline with pins);
//! - [`prefix_index`]: the [`PrefixIndex`], chained chunk hashes of rendered prompts and, per
//!   endpoint slot, an LRU model of which prefixes its KV cache holds, corrected by the cached
//!   token counts the engines report back;
//! - [`session_key`](mod@session_key): which agent session a request belongs to ([`session_key()`]), from the
//!   configured session header, the coding agents' native headers, `prompt_cache_key`, the
//!   `previous_response_id` chain root or the `conversation` id;
//! - [`lineage`](mod@lineage): whether a request comes from a sub-agent and which session spawned it
//!   ([`lineage()`]), from a configured parent header or the agents' native sub-agent headers;
//! - [`prefix_lineage`]: the parent of a call whose headers name none, found by the prefix
//!   its prompt shares with an active session ([`PrefixLineage`]), without mistaking a team's
//!   common prefix for a parent's context;
//! - [`disagg`]: prefill/decode disaggregation: when remote prefill pays off, the prefill
//!   endpoint pick ([`PrefillPicker`]: prefix match and load weighed by measured throughput,
//!   with its own sticky pin), and each endpoint's measured prefill throughput.
//!
//! Session pins themselves live in the store (`agentgate-sessions`), so every gateway replica
//! sees the same pin. Per request, the caller reads the pin and passes its position in the
//! endpoint list as [`PickRequest::pinned`]; the pick holds it or reports why it broke, and the
//! caller re-pins (and counts the move) when the chosen endpoint differs. The prefix index is
//! keyed by [`Endpoint::slot`], so it survives changes to the endpoint list.

pub mod disagg;
pub mod endpoint;
pub mod filter;
pub mod flow;
pub mod lineage;
pub mod picker;
pub mod pin;
pub mod pipeline;
pub mod policy;
pub mod prefix_index;
pub mod prefix_lineage;
pub mod scorer;
pub mod session_key;

pub use disagg::{
    prefill_pin_key, remote_prefill_pays_off, PrefillPicker, PrefillRequest, PrefillThroughput,
};
pub use endpoint::{Endpoint, InFlight, LoadReport, Role, Saturation};
pub use filter::{Filter, PoolView};
pub use flow::{
    BandSpec, CapacitySignal, FlowConfig, FlowController, FlowSnapshot, LocalRateLimiter,
    MaxInFlight, Permit, RateLimiter, Rejection, TeamSpec, Ticket,
};
pub use lineage::{lineage, Lineage, LineageConfig};
pub use picker::{
    BreakCause, LeastLoaded, Pick, PickRequest, Picker, PinOutcome, Pinned, Reason, RoundRobin,
};
pub use pin::{PinCost, PinRule};
pub use pipeline::{Pipeline, ScoringConfig};
pub use policy::Policy;
pub use prefix_index::{chunk_hashes, Occupancy, PrefixIndex, PrefixIndexConfig};
pub use prefix_lineage::{Observation, PrefixLineage, PrefixLineageConfig};
pub use scorer::{ScoreContext, Scorer, SCORER_NAMES};
pub use session_key::{chain_root_key, session_key, SessionKey, SessionKeyConfig, SessionSource};
