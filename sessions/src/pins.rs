//! Session -> endpoint pins: which endpoint of a pool holds a session's KV cache, shared by every
//! gateway replica through the store so all of them route a session's turns to the same place.
//!
//! A pin is stored under `{prefix}pin:{pool}:{session}` with its own TTL
//! ([`crate::StoreOptions::pin_ttl`]), refreshed by every read, swap and [`crate::Store::touch_pin`].
//! Changing a pin is a compare-and-set ([`crate::Store::swap_pin`]), so when two gateways decide
//! to move the same session at once exactly one move applies and both route to the winner.
//!
//! Key safety: session keys come from clients. [`pin_key`] percent-encodes every byte of the pool
//! and session outside `A-Z a-z 0-9 - _ .`, so `:` cannot shift the pool/session boundary and
//! glob characters and Redis Cluster hash tags (`{...}`) have no effect; a part whose encoding is
//! longer than [`MAX_KEY_PART_LEN`] is replaced by a readable head plus `#` and its 128-bit
//! xxh3 hash, so a key's length is bounded whatever the client sends.
//!
//! This module does not scope pins by team: the gateway does, by prefixing the session keys of
//! each team (`agentgate::turn::team_session_key`), so one team's turns can neither move
//! another's pin nor learn where it points.

/// Where a session's turns go, and how often it has moved.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SessionPin {
    /// Name of the endpoint (within the pool) that holds the session's cache.
    pub endpoint: String,
    /// How many times the session has been moved to another endpoint.
    pub moves: u32,
    /// The endpoint's base URL when the pin was set. A name can come to stand for another
    /// engine (config endpoints are named by their place in the list, and pins outlive a
    /// gateway restart): a pin whose endpoint now has another URL is treated as gone. Absent in
    /// pins written before it existed, which match by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
}

impl SessionPin {
    /// Whether `self` and `other` are the same pin for a compare-and-set: same endpoint and
    /// move count (what the Redis script compares).
    pub fn same_as(&self, other: &SessionPin) -> bool {
        self.endpoint == other.endpoint && self.moves == other.moves
    }
}

/// What a compare-and-set of a pin ([`crate::Store::swap_pin`]) left in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinSwap {
    /// The pin in force afterwards: the new one if this swap applied, else the one another
    /// swap set first (which may equal the new one, when both moved the session alike).
    pub pin: SessionPin,
    /// Whether this swap wrote the pin (a move to count), rather than finding another in force.
    pub applied: bool,
}

/// Longest encoded pool or session part kept verbatim in a key; longer ones are hashed.
pub const MAX_KEY_PART_LEN: usize = 96;

/// How many leading characters of an over-long encoded part stay readable before its hash.
const HASHED_HEAD_LEN: usize = 48;

/// The store key of the pin of `session` in `pool`: `{prefix}pin:{pool}:{session}` with both
/// parts encoded by [`encode_key_part`].
pub fn pin_key(prefix: &str, pool: &str, session: &str) -> String {
    format!(
        "{prefix}pin:{}:{}",
        encode_key_part(pool),
        encode_key_part(session)
    )
}

/// `part` made safe and bounded for use inside a key: bytes outside `A-Z a-z 0-9 - _ .` become
/// `%XX`; if the result is longer than [`MAX_KEY_PART_LEN`] it becomes its first 48 characters,
/// `#`, and the 32 hex digits of the xxh3-128 hash of `part` (`#` never appears otherwise).
pub fn encode_key_part(part: &str) -> String {
    let mut encoded = String::with_capacity(part.len());
    for byte in part.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.') {
            encoded.push(char::from(byte));
        } else {
            encoded.push('%');
            encoded.push(hex_digit(byte >> 4));
            encoded.push(hex_digit(byte & 0x0f));
        }
    }
    if encoded.len() <= MAX_KEY_PART_LEN {
        return encoded;
    }
    // The encoding is pure ASCII, so truncating at any byte index is a char boundary.
    encoded.truncate(HASHED_HEAD_LEN);
    let hash = xxhash_rust::xxh3::xxh3_128(part.as_bytes());
    encoded.push('#');
    encoded.push_str(&format!("{hash:032x}"));
    encoded
}

fn hex_digit(nibble: u8) -> char {
    char::from(b"0123456789ABCDEF"[usize::from(nibble & 0x0f)])
}

/// A pin as stored (compact JSON; the Redis swap script compares these bytes).
pub(crate) fn encode_pin(pin: &SessionPin) -> Result<String, crate::StoreError> {
    serde_json::to_string(pin)
        .map_err(|e| crate::StoreError::Backend(format!("encode session pin: {e}")))
}

/// Decode a stored pin; `key` names it in the error.
pub(crate) fn decode_pin(key: &str, bytes: &[u8]) -> Result<SessionPin, crate::StoreError> {
    serde_json::from_slice(bytes).map_err(|e| crate::StoreError::CorruptPin {
        key: key.to_string(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_keys_stay_readable() {
        assert_eq!(
            pin_key("ag:", "default", "0b9f6a3e-1c2d-4e5f-8a9b-0c1d2e3f4a5b"),
            "ag:pin:default:0b9f6a3e-1c2d-4e5f-8a9b-0c1d2e3f4a5b"
        );
    }

    #[test]
    fn separators_globs_and_hash_tags_are_encoded() {
        assert_eq!(encode_key_part("a:b"), "a%3Ab");
        assert_eq!(encode_key_part("{x}*?[%"), "%7Bx%7D%2A%3F%5B%25");
        assert_eq!(encode_key_part("é\n "), "%C3%A9%0A%20");
        assert_eq!(encode_key_part(""), "");
        assert_ne!(pin_key("p:", "a", "b:c"), pin_key("p:", "a:b", "c"));
        assert_ne!(encode_key_part("%3A"), encode_key_part(":"));
    }

    #[test]
    fn long_parts_are_hashed_to_a_bounded_length() {
        let at_limit = "x".repeat(MAX_KEY_PART_LEN);
        assert_eq!(encode_key_part(&at_limit), at_limit);
        let long = "y".repeat(10_000);
        let encoded = encode_key_part(&long);
        assert_eq!(encoded.len(), HASHED_HEAD_LEN + 1 + 32);
        assert!(encoded.starts_with(&"y".repeat(HASHED_HEAD_LEN)));
        let mut other = long.clone();
        other.push('z');
        assert_ne!(encode_key_part(&other), encoded);
        let wide = ":".repeat(MAX_KEY_PART_LEN);
        assert_eq!(encode_key_part(&wide).len(), HASHED_HEAD_LEN + 1 + 32);
    }

    #[test]
    fn pins_round_trip_and_bad_bytes_are_reported() {
        let pin = SessionPin {
            endpoint: "vllm-0".into(),
            moves: 3,
            url: None,
        };
        let json = encode_pin(&pin).unwrap();
        assert_eq!(json, r#"{"endpoint":"vllm-0","moves":3}"#);
        assert_eq!(decode_pin("k", json.as_bytes()).unwrap(), pin);
        let err = decode_pin("k", b"{oops").unwrap_err();
        assert!(matches!(err, crate::StoreError::CorruptPin { .. }), "{err}");
    }
}
