//! agentgate's scheduler: which endpoint serves a request (and, later, when it is admitted).
//!
//! - [`flow`]: multi-team flow control, the [`FlowController`]: priority bands, weighted fair
//!   queuing across teams over tokens, turn-first order within a team, shedding, queue TTLs
//!   and per-team rate limits (formulas in its module doc);
//! - [`endpoint`]: one engine replica and the gateway's own live view of its load (in-flight
//!   requests and prompt tokens, counted by RAII guards, fresher than any metrics scrape);
//! - [`picker`]: the [`Picker`] trait and the baseline policies, [`RoundRobin`] and
//!   [`LeastLoaded`];
//! - [`policy`]: the policy names the configuration accepts (`round_robin`, `least_loaded`,
//!   `prefix`, `session`);
//! - [`prefix_aware`]: the [`PrefixAware`] picker behind `prefix` and `session`: prefix match
//!   times an anti-herding gate, plus load (formula in its module doc);
//! - [`prefix_index`]: the [`PrefixIndex`], chained chunk hashes of rendered prompts and, per
//!   endpoint, an LRU model of which prefixes its KV cache holds, scored in [0, 1];
//! - [`session_key`](mod@session_key): which agent session a request belongs to ([`session_key()`]), from the
//!   configured session header, the coding agents' native headers, `prompt_cache_key`, the
//!   `previous_response_id` chain root or the `conversation` id.
//!
//! Session pins themselves live in the store (`agentgate-sessions`), so every gateway replica
//! sees the same pin; the gateway reads the pin, keeps the session on it while
//! [`Picker::crowded`] says no, and otherwise asks the picker and re-pins.

pub mod endpoint;
pub mod flow;
pub mod picker;
pub mod policy;
pub mod prefix_aware;
pub mod prefix_index;
pub mod session_key;

pub use endpoint::{Endpoint, InFlight, LoadReport, Role, Saturation};
pub use flow::{
    BandSpec, CapacitySignal, FlowConfig, FlowController, FlowSnapshot, LocalRateLimiter,
    MaxInFlight, Permit, RateLimiter, Rejection, TeamSpec, Ticket,
};
pub use picker::{LeastLoaded, PickRequest, Picker, RoundRobin};
pub use policy::Policy;
pub use prefix_aware::{PrefixAware, PrefixWeights};
pub use prefix_index::{chunk_hashes, PrefixIndex, PrefixIndexConfig};
pub use session_key::{chain_root_key, session_key, SessionKey, SessionKeyConfig, SessionSource};
