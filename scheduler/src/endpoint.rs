//! One engine replica and the gateway's live count of the work it has sent there.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// One engine replica.
#[derive(Debug)]
pub struct Endpoint {
    /// Display name (`pool/index`), safe to show in headers and logs.
    pub name: String,
    /// Base URL, e.g. `http://127.0.0.1:8100`.
    pub base_url: String,
    in_flight_requests: AtomicU64,
    in_flight_tokens: AtomicU64,
}

impl Endpoint {
    /// A new endpoint with no work in flight.
    pub fn new(name: impl Into<String>, base_url: impl Into<String>) -> Self {
        Endpoint {
            name: name.into(),
            base_url: base_url.into(),
            in_flight_requests: AtomicU64::new(0),
            in_flight_tokens: AtomicU64::new(0),
        }
    }

    /// Requests this gateway process has in flight on the endpoint.
    pub fn in_flight_requests(&self) -> u64 {
        self.in_flight_requests.load(Ordering::Relaxed)
    }

    /// Prompt tokens (estimated) of those requests.
    pub fn in_flight_tokens(&self) -> u64 {
        self.in_flight_tokens.load(Ordering::Relaxed)
    }

    /// Count a request as in flight until the returned guard drops.
    pub fn begin(self: &Arc<Self>, prompt_tokens: u64) -> InFlight {
        self.in_flight_requests.fetch_add(1, Ordering::Relaxed);
        self.in_flight_tokens
            .fetch_add(prompt_tokens, Ordering::Relaxed);
        InFlight {
            endpoint: self.clone(),
            tokens: prompt_tokens,
        }
    }
}

/// Holds one request's share of an endpoint's in-flight counts; released on drop, so a failed
/// or abandoned request can never leak load.
#[derive(Debug)]
pub struct InFlight {
    endpoint: Arc<Endpoint>,
    tokens: u64,
}

impl InFlight {
    /// The endpoint this request runs on.
    pub fn endpoint(&self) -> &Arc<Endpoint> {
        &self.endpoint
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.endpoint
            .in_flight_requests
            .fetch_sub(1, Ordering::Relaxed);
        self.endpoint
            .in_flight_tokens
            .fetch_sub(self.tokens, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_count_and_release() {
        let ep = Arc::new(Endpoint::new("p/0", "http://127.0.0.1:1"));
        let a = ep.begin(100);
        let b = ep.begin(50);
        assert_eq!((ep.in_flight_requests(), ep.in_flight_tokens()), (2, 150));
        drop(a);
        assert_eq!((ep.in_flight_requests(), ep.in_flight_tokens()), (1, 50));
        drop(b);
        assert_eq!((ep.in_flight_requests(), ep.in_flight_tokens()), (0, 0));
    }
}
