//! `agentgate-bench` library: the parts of the benchmark suite that tests and the binary share.
//!
//! [`workload`] generates the sessions a benchmark replays (agentic, chat, mixed, trace replay);
//! [`oracle`] computes the prompt tokens the simulator sees and the cache reuse an ideal fleet
//! would capture; [`run`] replays a workload against the gateway once per routing policy and
//! writes the comparison.

pub mod duration;
pub mod oracle;
pub mod run;
pub mod workload;
