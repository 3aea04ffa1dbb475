//! API keys -> teams. Keys are configured as SHA-256 digests and never logged.
//!
//! When no `[[teams]]` entry lists a key (`api_key_sha256`) the gateway runs open: every request
//! (any bearer token or none) belongs to team `default`, and start-up says so. Otherwise a
//! request needs `Authorization: Bearer KEY` whose digest a team lists (a digest names one
//! team); anything else gets 401 in OpenAI's shape. The key ring is replaced whole when the
//! config file's `[[teams]]` change ([`KeyRing::replace`]); a reload that would leave a keyed
//! gateway without keys is refused (`crate::reload`).

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};

use axum::http::{header, HeaderMap};
use sha2::{Digest, Sha256};

use crate::config::TeamConfig;
use crate::error::HttpError;

/// The team a request runs as; scopes every stored object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Team(pub String);

/// Name of the team used when the gateway runs open.
pub const OPEN_TEAM: &str = "default";

/// Maps key digests to team names.
#[derive(Debug, Default)]
pub struct KeyRing {
    by_digest: RwLock<Arc<HashMap<[u8; 32], String>>>,
}

/// SHA-256 of a key, lowercase hex (what `api_key_sha256` holds).
pub fn hash_key(key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

fn parse_hex32(s: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    if s.len() != 64 {
        return None;
    }
    for (i, chunk) in s.as_bytes().chunks(2).enumerate() {
        let hex = std::str::from_utf8(chunk).ok()?;
        out[i] = u8::from_str_radix(hex, 16).ok()?;
    }
    Some(out)
}

fn digests(teams: &[TeamConfig]) -> HashMap<[u8; 32], String> {
    let mut by_digest = HashMap::new();
    for team in teams {
        for digest in &team.api_key_sha256 {
            if let Some(d) = parse_hex32(&digest.to_ascii_lowercase()) {
                by_digest.insert(d, team.name.clone());
            }
        }
    }
    by_digest
}

impl KeyRing {
    /// Build from the `[[teams]]` section (digests were validated with the config).
    pub fn new(teams: &[TeamConfig]) -> Self {
        KeyRing {
            by_digest: RwLock::new(Arc::new(digests(teams))),
        }
    }

    /// Switch to the keys of `teams` (a reloaded `[[teams]]` section). Requests already
    /// authenticated keep their team.
    pub fn replace(&self, teams: &[TeamConfig]) {
        *self
            .by_digest
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Arc::new(digests(teams));
    }

    fn current(&self) -> Arc<HashMap<[u8; 32], String>> {
        self.by_digest
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// True when no keys are configured and every request runs as [`OPEN_TEAM`].
    pub fn is_open(&self) -> bool {
        self.current().is_empty()
    }

    /// The team for a request's headers, or 401.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Team, HttpError> {
        let by_digest = self.current();
        if by_digest.is_empty() {
            return Ok(Team(OPEN_TEAM.to_string()));
        }
        let unauthorized = |msg: &str| {
            HttpError::new(
                401,
                "invalid_request_error",
                msg,
                None,
                Some("invalid_api_key"),
            )
        };
        let value = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| {
                unauthorized(
                    "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.",
                )
            })?;
        // Only a bearer token with something in it is a key (any other scheme, or none, is
        // not: it must never match the digest of the empty string).
        let key = value
            .get(..7)
            .filter(|scheme| scheme.eq_ignore_ascii_case("bearer "))
            .and_then(|_| value.get(7..))
            .map(str::trim)
            .filter(|key| !key.is_empty())
            .ok_or_else(|| {
                unauthorized(
                    "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.",
                )
            })?;
        let digest: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        by_digest
            .get(&digest)
            .map(|name| Team(name.clone()))
            .ok_or_else(|| unauthorized("Incorrect API key provided."))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring() -> KeyRing {
        KeyRing::new(&[TeamConfig::new("alpha", vec![hash_key("sk-alpha")])])
    }

    fn bearer(k: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            format!("Bearer {k}").parse().unwrap(),
        );
        h
    }

    #[test]
    fn right_key_maps_to_team() {
        assert_eq!(
            ring().authenticate(&bearer("sk-alpha")).unwrap(),
            Team("alpha".into())
        );
    }

    #[test]
    fn wrong_or_missing_key_is_401() {
        let e = ring().authenticate(&bearer("sk-nope")).unwrap_err();
        assert_eq!(e.error.status, 401);
        assert_eq!(e.error.code.as_deref(), Some("invalid_api_key"));
        assert_eq!(
            ring()
                .authenticate(&HeaderMap::new())
                .unwrap_err()
                .error
                .status,
            401
        );
    }

    #[test]
    fn only_a_non_empty_bearer_token_is_a_key() {
        // Even a ring that (unvalidated) holds the empty key's digest.
        let empty = KeyRing::new(&[TeamConfig::new("empty", vec![hash_key("")])]);
        for value in ["Basic abc", "Bearer", "Bearer   ", "bearer ", "sk-empty"] {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, value.parse().unwrap());
            assert_eq!(
                empty.authenticate(&h).unwrap_err().error.status,
                401,
                "{value}"
            );
        }
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, "BEARER sk-alpha".parse().unwrap());
        assert_eq!(ring().authenticate(&h).unwrap().0, "alpha");
    }

    #[test]
    fn replaced_keys_apply_at_once() {
        let ring = ring();
        ring.replace(&[TeamConfig::new("beta", vec![hash_key("sk-beta")])]);
        assert_eq!(ring.authenticate(&bearer("sk-beta")).unwrap().0, "beta");
        assert_eq!(
            ring.authenticate(&bearer("sk-alpha"))
                .unwrap_err()
                .error
                .status,
            401
        );
        ring.replace(&[]);
        assert!(ring.is_open());
    }

    #[test]
    fn open_gateway_accepts_anything() {
        let open = KeyRing::new(&[]);
        assert!(open.is_open());
        assert_eq!(open.authenticate(&bearer("whatever")).unwrap().0, OPEN_TEAM);
    }
}
