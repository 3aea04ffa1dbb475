//! Why a request was not admitted, with the HTTP status, error code and `Retry-After` the
//! gateway answers with.

use std::fmt;
use std::time::Duration;

use super::rate_limit::{RateKind, RateLimited};

/// Which queue cap refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueLimit {
    /// `max_queued` requests.
    Requests,
    /// `max_queued_bytes`.
    Bytes,
}

/// A request that flow control did not admit.
#[derive(Debug, Clone, PartialEq)]
pub enum Rejection {
    /// The team is not configured.
    UnknownTeam {
        /// Team name.
        team: String,
    },
    /// The requested band is not configured.
    UnknownBand {
        /// Requested band.
        band: String,
    },
    /// The team may not use the requested band (not allowed, or above its default band).
    BandNotAllowed {
        /// Team name.
        team: String,
        /// Requested band.
        band: String,
        /// The team's default band (the highest it may use).
        default_band: String,
        /// The bands the team may use.
        allowed: Vec<String>,
    },
    /// Over the team's requests- or tokens-per-minute limit.
    RateLimited(RateLimited),
    /// The pool is saturated and the band is sheddable.
    Shed {
        /// Band name.
        band: String,
        /// Suggested wait before retrying.
        retry_after: Duration,
    },
    /// The band's queue is full.
    QueueFull {
        /// Band name.
        band: String,
        /// The cap that was hit.
        limit: QueueLimit,
        /// Suggested wait before retrying.
        retry_after: Duration,
    },
    /// The request waited its band's whole queue TTL without being dispatched.
    Timeout {
        /// Band name.
        band: String,
        /// How long it waited.
        waited: Duration,
        /// Suggested wait before retrying.
        retry_after: Duration,
    },
    /// The team was removed from the configuration while the request was queued.
    TeamRemoved {
        /// Team name.
        team: String,
    },
}

impl Rejection {
    /// The HTTP status to answer with: 400 unknown band, 403 unknown/removed team or band not
    /// allowed, 429 rate-limited / shed / queue full, 503 queue timeout.
    pub fn http_status(&self) -> u16 {
        match self {
            Rejection::UnknownBand { .. } => 400,
            Rejection::UnknownTeam { .. }
            | Rejection::BandNotAllowed { .. }
            | Rejection::TeamRemoved { .. } => 403,
            Rejection::RateLimited(_) | Rejection::Shed { .. } | Rejection::QueueFull { .. } => 429,
            Rejection::Timeout { .. } => 503,
        }
    }

    /// The error `code` for an OpenAI-shaped error body, saying which limit was hit.
    pub fn code(&self) -> &'static str {
        match self {
            Rejection::UnknownTeam { .. } => "unknown_team",
            Rejection::UnknownBand { .. } => "unknown_band",
            Rejection::BandNotAllowed { .. } => "band_not_allowed",
            Rejection::RateLimited(limited) if limited.exceeds_limit => "request_too_large",
            Rejection::RateLimited(limited) => match limited.kind {
                RateKind::Requests => "rate_limit_exceeded_requests",
                RateKind::Tokens => "rate_limit_exceeded_tokens",
            },
            Rejection::Shed { .. } => "overloaded_shed",
            Rejection::QueueFull { .. } => "queue_full",
            Rejection::Timeout { .. } => "queue_timeout",
            Rejection::TeamRemoved { .. } => "team_removed",
        }
    }

    /// How long the client should wait before retrying, if retrying can help.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Rejection::RateLimited(limited) if limited.exceeds_limit => None,
            Rejection::RateLimited(limited) => Some(limited.retry_after),
            Rejection::Shed { retry_after, .. }
            | Rejection::QueueFull { retry_after, .. }
            | Rejection::Timeout { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }

    /// The `Retry-After` header value: whole seconds, rounded up, at least 1.
    pub fn retry_after_secs(&self) -> Option<u64> {
        self.retry_after().map(|d| {
            let secs = d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0));
            secs.max(1)
        })
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rejection::UnknownTeam { team } => write!(f, "team `{team}` is not configured"),
            Rejection::UnknownBand { band } => write!(f, "band `{band}` is not configured"),
            Rejection::BandNotAllowed {
                team,
                band,
                default_band,
                allowed,
            } => write!(
                f,
                "team `{team}` may not use band `{band}`: it may use [{}], none above its default \
                 band `{default_band}`",
                allowed.join(", ")
            ),
            Rejection::RateLimited(limited) => limited.fmt(f),
            Rejection::Shed { band, .. } => write!(
                f,
                "the pool is saturated and band `{band}` is sheddable; retry later"
            ),
            Rejection::QueueFull { band, limit, .. } => {
                let what = match limit {
                    QueueLimit::Requests => "requests",
                    QueueLimit::Bytes => "bytes",
                };
                write!(
                    f,
                    "band `{band}` has its maximum of queued {what}; retry later"
                )
            }
            Rejection::Timeout { band, waited, .. } => write!(
                f,
                "waited {:.1}s in band `{band}`, its queue TTL, without capacity; retry later",
                waited.as_secs_f64()
            ),
            Rejection::TeamRemoved { team } => write!(
                f,
                "team `{team}` was removed from the configuration while the request was queued"
            ),
        }
    }
}

impl std::error::Error for Rejection {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_codes_and_retry_after() {
        let shed = Rejection::Shed {
            band: "batch".into(),
            retry_after: Duration::from_millis(1500),
        };
        assert_eq!(shed.http_status(), 429);
        assert_eq!(shed.code(), "overloaded_shed");
        assert_eq!(shed.retry_after_secs(), Some(2));
        let timeout = Rejection::Timeout {
            band: "interactive".into(),
            waited: Duration::from_secs(30),
            retry_after: Duration::ZERO,
        };
        assert_eq!(timeout.http_status(), 503);
        assert_eq!(timeout.retry_after_secs(), Some(1));
        assert!(timeout.to_string().contains("waited 30.0s"));
        let forever = Rejection::Shed {
            band: "batch".into(),
            retry_after: Duration::MAX,
        };
        assert_eq!(forever.retry_after_secs(), Some(u64::MAX));
        let unknown = Rejection::UnknownBand { band: "x".into() };
        assert_eq!(unknown.http_status(), 400);
        assert_eq!(unknown.retry_after(), None);
    }
}
