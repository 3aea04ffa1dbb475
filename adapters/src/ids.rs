//! Identifier generation for Responses items (`msg_`, `fc_`, `fco_`, `rs_`, `call_` + hex).
//!
//! Input items the gateway names get 48 random hex digits. Output items are named after their
//! response ([`output_item_id`]): the response id's 48 hex digits and an 8-digit counter, so a
//! later request that refers to one by its id alone (`item_reference`, without
//! `previous_response_id` or `conversation`) finds the response that holds it
//! ([`response_of_item`]) without an index beside the store.

/// A new identifier: `prefix` followed by 48 random hex digits (e.g. `msg_3f2a...`).
pub fn new_item_id(prefix: &str) -> String {
    let mut id = String::with_capacity(prefix.len() + 48);
    id.push_str(prefix);
    push_random_hex(&mut id);
    id
}

/// Append 48 hex digits from the operating system's random source: ids must not be guessable
/// from others (a fast generator's are: its state shows in what it returns), since on a
/// gateway without keys an id is all that guards a stored response or conversation.
pub fn push_random_hex(out: &mut String) {
    let mut bytes = [0u8; 24];
    if getrandom::fill(&mut bytes).is_err() {
        // (No OS source: never on the platforms the gateway runs on.)
        bytes.iter_mut().for_each(|b| *b = fastrand::u8(..));
    }
    for b in bytes {
        out.push(char::from(b"0123456789abcdef"[usize::from(b >> 4)]));
        out.push(char::from(b"0123456789abcdef"[usize::from(b & 15)]));
    }
}

/// Hex digits of a response id (`resp_` + 48 hex digits).
const RESPONSE_HEX: usize = 48;

/// The id of output item `n` of response `response_id`: `prefix`, the response id's hex digits
/// and `n` in 8 hex digits. A response id of another shape (none made here) gives a random id.
pub fn output_item_id(prefix: &str, response_id: &str, n: u32) -> String {
    match response_id.strip_prefix("resp_") {
        Some(hex) if hex.len() == RESPONSE_HEX && hex.bytes().all(|b| b.is_ascii_hexdigit()) => {
            format!("{prefix}{hex}{n:08x}")
        }
        _ => new_item_id(prefix),
    }
}

/// The response an output item id made by [`output_item_id`] belongs to (`resp_...`); `None`
/// for any other id.
pub fn response_of_item(item_id: &str) -> Option<String> {
    let (_, rest) = item_id.split_once('_')?;
    let hex_only = rest.bytes().all(|b| b.is_ascii_hexdigit());
    (rest.len() == RESPONSE_HEX + 8 && hex_only).then(|| format!("resp_{}", &rest[..RESPONSE_HEX]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_item_ids_name_their_response() {
        let resp = format!("resp_{}", "ab12".repeat(12));
        let first = output_item_id("msg_", &resp, 0);
        let second = output_item_id("fc_", &resp, 1);
        assert_ne!(first[4..], second[3..]);
        assert_eq!(response_of_item(&first), Some(resp.clone()));
        assert_eq!(response_of_item(&second), Some(resp));
        // Random ids, and ids of other shapes, name no response.
        assert_eq!(response_of_item(&new_item_id("msg_")), None);
        assert_eq!(response_of_item("msg_client-chosen"), None);
        assert_eq!(response_of_item("nounderscore"), None);
        assert!(output_item_id("msg_", "resp_short", 0).starts_with("msg_"));
        assert_eq!(
            response_of_item(&output_item_id("msg_", "resp_short", 0)),
            None
        );
    }

    #[test]
    fn ids_have_prefix_and_differ() {
        let a = new_item_id("msg_");
        let b = new_item_id("msg_");
        assert!(a.starts_with("msg_"));
        assert_eq!(a.len(), 4 + 48);
        assert_ne!(a, b);
    }
}
