//! Incremental parsing of a Responses API event stream (`text/event-stream`): bytes in, one JSON
//! payload per complete event out.

use serde_json::Value;

/// Splits a byte stream into server-sent events and decodes their `data:` payloads as JSON.
#[derive(Debug, Default)]
pub struct SseParser {
    buffer: Vec<u8>,
}

/// One decoded event: its type (`event:` line, else the payload's `type`) and payload.
#[derive(Debug, Clone, PartialEq)]
pub struct SseEvent {
    /// Event type, e.g. `response.output_text.delta`.
    pub kind: String,
    /// The JSON payload (`Value::Null` when the data was not JSON, e.g. `[DONE]`).
    pub data: Value,
}

impl SseParser {
    /// Feed the next chunk of bytes; returns every event completed by it.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<SseEvent> {
        self.buffer.extend_from_slice(chunk);
        let mut events = Vec::new();
        while let Some((end, separator)) = find_event_end(&self.buffer) {
            let block: Vec<u8> = self.buffer.drain(..end + separator).collect();
            if let Some(event) = parse_block(block.get(..end).unwrap_or_default()) {
                events.push(event);
            }
        }
        events
    }
}

/// Position and length of the first blank-line separator (`\n\n` or `\r\n\r\n`).
fn find_event_end(buffer: &[u8]) -> Option<(usize, usize)> {
    let lf = buffer.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = buffer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

fn parse_block(block: &[u8]) -> Option<SseEvent> {
    let text = String::from_utf8_lossy(block);
    let mut kind = None;
    let mut data = String::new();
    for line in text.lines() {
        if let Some(value) = line.strip_prefix("event:") {
            kind = Some(value.trim().to_string());
        } else if let Some(value) = line.strip_prefix("data:") {
            if !data.is_empty() {
                data.push('\n');
            }
            data.push_str(value.strip_prefix(' ').unwrap_or(value));
        }
    }
    if kind.is_none() && data.is_empty() {
        return None;
    }
    let payload: Value = serde_json::from_str(&data).unwrap_or(Value::Null);
    let kind = kind
        .or_else(|| {
            payload
                .get("type")
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .unwrap_or_default();
    Some(SseEvent {
        kind,
        data: payload,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn events_split_across_chunks_are_reassembled() {
        let mut parser = SseParser::default();
        let stream = "event: response.created\ndata: {\"type\":\"response.created\"}\n\n\
                      data: {\"type\":\"response.output_text.delta\",\"delta\":\"hi\"}\r\n\r\n: ping\n\n";
        let bytes = stream.as_bytes();
        let mut events = parser.push(&bytes[..30]);
        assert!(events.is_empty());
        events.extend(parser.push(&bytes[30..]));
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].kind, "response.created");
        assert_eq!(events[1].kind, "response.output_text.delta");
        assert_eq!(events[1].data["delta"], json!("hi"));
    }
}
