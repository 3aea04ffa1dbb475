//! The `encrypted_content` of reasoning items this gateway produces.
//!
//! Engines have no server-side reasoning store, so when a client asks for
//! `include: ["reasoning.encrypted_content"]` (Codex does, with `store: false`) the reasoning text
//! is carried by the client instead: `encrypted_content` is standard base64 of the JSON
//! `{"agentgate_reasoning": 1, "text": "<reasoning text>"}`. It is NOT encrypted and NOT secret —
//! it is an opaque round-trip token. [`decode_reasoning_blob`] recovers the text when the item
//! comes back in a later turn's input; blobs from other providers decode to `None`.

use serde_json::json;

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
const FORMAT_KEY: &str = "agentgate_reasoning";

/// Encodes reasoning text as the opaque `encrypted_content` value described in the module doc.
pub fn encode_reasoning_blob(text: &str) -> String {
    encode_tagged(FORMAT_KEY, text)
}

/// Decodes an `encrypted_content` value made by [`encode_reasoning_blob`]; `None` for anything else.
pub fn decode_reasoning_blob(blob: &str) -> Option<String> {
    decode_tagged(FORMAT_KEY, blob)
}

/// Standard base64 of the JSON `{"<key>": 1, "text": "<text>"}`: an opaque round-trip token
/// whose `key` says what it holds.
pub(crate) fn encode_tagged(key: &str, text: &str) -> String {
    base64_encode(json!({ key: 1, "text": text }).to_string().as_bytes())
}

/// The fields a token may carry: one tag per kind, and the text. Read into this, not a
/// `Value`, so that a blob of some other shape (a client's, say a huge array) is skipped
/// without building it in memory.
#[derive(serde::Deserialize)]
struct Tagged {
    agentgate_reasoning: Option<u64>,
    agentgate_compaction: Option<u64>,
    text: String,
}

/// The text of a token made by [`encode_tagged`] with the same `key` (one of the tags of
/// [`Tagged`]); `None` for anything else.
pub(crate) fn decode_tagged(key: &str, blob: &str) -> Option<String> {
    let bytes = base64_decode(blob.trim())?;
    let tagged: Tagged = serde_json::from_slice(&bytes).ok()?;
    let tag = match key {
        FORMAT_KEY => tagged.agentgate_reasoning,
        crate::compaction::FORMAT_KEY => tagged.agentgate_compaction,
        _ => None,
    };
    (tag == Some(1)).then_some(tagged.text)
}

fn base64_encode(input: &[u8]) -> String {
    let mut out = String::with_capacity(input.len().div_ceil(3) * 4);
    for chunk in input.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn base64_decode(input: &str) -> Option<Vec<u8>> {
    let trimmed = input.trim_end_matches('=');
    let mut out = Vec::with_capacity(trimmed.len() * 3 / 4);
    let mut acc: u32 = 0;
    let mut bits = 0u32;
    for c in trimmed.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push(((acc >> bits) & 0xff) as u8);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_known_vectors() {
        assert_eq!(base64_encode(b""), "");
        assert_eq!(base64_encode(b"f"), "Zg==");
        assert_eq!(base64_encode(b"fo"), "Zm8=");
        assert_eq!(base64_encode(b"foo"), "Zm9v");
        assert_eq!(base64_encode(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64_decode("Zm9vYmE=").as_deref(), Some(&b"fooba"[..]));
    }

    #[test]
    fn blob_round_trips_unicode_text() {
        let text = "first, check the \"tests\" — then 🚀\nline two";
        let blob = encode_reasoning_blob(text);
        assert_eq!(decode_reasoning_blob(&blob).as_deref(), Some(text));
    }

    #[test]
    fn foreign_blobs_decode_to_none() {
        assert_eq!(decode_reasoning_blob("gAAAAABo-not-ours"), None);
        assert_eq!(
            decode_reasoning_blob(&base64_encode(b"{\"text\":\"x\"}")),
            None
        );
        assert_eq!(decode_reasoning_blob("%%%"), None);
    }
}
