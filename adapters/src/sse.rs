//! Incremental decoder for `text/event-stream` bodies: bytes in, `data:` payloads out.
//!
//! Handles `\n` and `\r\n` line ends, multi-line `data:` fields (joined with `\n`), comment lines
//! and fields other than `data` (ignored), and payloads split across network reads.

/// Most bytes one event may buffer (its unfinished line plus its `data:` lines so far). An
/// engine's events are a few hundred bytes; a stream that goes past this is broken, and keeping
/// it would let one upstream grow the gateway's memory without bound.
pub const MAX_EVENT_BYTES: usize = 16 << 20;

/// An event grew past [`MAX_EVENT_BYTES`] without ending.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OversizedEvent;

impl std::fmt::Display for OversizedEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "an event grew past {} MiB without ending",
            MAX_EVENT_BYTES >> 20
        )
    }
}

/// Accumulates bytes and yields the data payload of each complete event.
///
/// Each byte is scanned for a line end once, and consumed lines leave the buffer in one move per
/// read, so the cost of a read does not grow with what is already buffered
/// (`benches/benches/sse_decode.rs`).
#[derive(Debug, Default)]
pub struct SseDecoder {
    buffer: Vec<u8>,
    /// Bytes at the start of `buffer` already known to hold no line end.
    scanned: usize,
    data: DataLines,
}

/// The `data:` lines of the event being read.
#[derive(Debug, Default)]
struct DataLines {
    lines: Vec<String>,
    bytes: usize,
}

impl SseDecoder {
    /// Feeds bytes; returns the payloads of the events completed by them, or an error once an
    /// event outgrows [`MAX_EVENT_BYTES`] (the decoder should then be dropped).
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<String>, OversizedEvent> {
        self.buffer.extend_from_slice(bytes);
        let mut payloads = Vec::new();
        let mut start = 0;
        let mut from = self.scanned;
        while let Some(offset) = self.buffer[from..].iter().position(|b| *b == b'\n') {
            let end = from + offset;
            let mut line = &self.buffer[start..end];
            if line.last() == Some(&b'\r') {
                line = &line[..line.len() - 1];
            }
            handle_line(
                &mut self.data,
                &String::from_utf8_lossy(line),
                &mut payloads,
            );
            start = end + 1;
            from = start;
        }
        self.buffer.drain(..start);
        self.scanned = self.buffer.len();
        if self.buffer.len().saturating_add(self.data.bytes) > MAX_EVENT_BYTES {
            return Err(OversizedEvent);
        }
        Ok(payloads)
    }

    /// Flushes an event left open at end of stream (no trailing blank line).
    pub fn finish(&mut self) -> Option<String> {
        self.scanned = 0;
        if !self.buffer.is_empty() {
            let rest = std::mem::take(&mut self.buffer);
            let line = String::from_utf8_lossy(&rest);
            let mut payloads = Vec::new();
            handle_line(&mut self.data, line.trim_end_matches('\r'), &mut payloads);
            if let Some(payload) = payloads.pop() {
                return Some(payload);
            }
        }
        self.data.take()
    }
}

impl DataLines {
    fn take(&mut self) -> Option<String> {
        self.bytes = 0;
        if self.lines.is_empty() {
            None
        } else {
            Some(std::mem::take(&mut self.lines).join("\n"))
        }
    }
}

fn handle_line(data: &mut DataLines, line: &str, payloads: &mut Vec<String>) {
    if line.is_empty() {
        payloads.extend(data.take());
        return;
    }
    if line.starts_with(':') {
        return;
    }
    let (field, value) = match line.split_once(':') {
        Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
        None => (line, ""),
    };
    if field == "data" {
        // A line costs its `String` too: a stream of empty `data` lines must not hold many
        // times the cap in line headers.
        data.bytes += value.len() + 1 + std::mem::size_of::<String>();
        data.lines.push(value.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_split_events_and_crlf() {
        let mut decoder = SseDecoder::default();
        assert!(decoder.push(b"data: {\"a\"").unwrap().is_empty());
        assert_eq!(
            decoder
                .push(b":1}\n\n: keepalive\n\ndata: x\r\n\r\n")
                .unwrap(),
            vec!["{\"a\":1}", "x"]
        );
        assert_eq!(
            decoder
                .push(b"event: e\ndata: l1\ndata: l2\n\ndata: [DONE]")
                .unwrap(),
            vec!["l1\nl2"]
        );
        assert_eq!(decoder.finish().as_deref(), Some("[DONE]"));
        assert_eq!(decoder.finish(), None);
    }

    #[test]
    fn many_empty_data_lines_count_against_the_cap() {
        // 5 bytes a line on the wire, some 30 in memory: refused long before memory is 30
        // times the cap.
        let lines = b"data\n".repeat(MAX_EVENT_BYTES / 16);
        let mut decoder = SseDecoder::default();
        assert!(decoder.push(&lines).is_err());
    }

    #[test]
    fn multibyte_characters_split_across_reads_survive() {
        let mut decoder = SseDecoder::default();
        let bytes = "data: héllo\n\n".as_bytes();
        let (a, b) = bytes.split_at(8);
        assert!(decoder.push(a).unwrap().is_empty());
        assert_eq!(decoder.push(b).unwrap(), vec!["héllo"]);
    }

    #[test]
    fn a_line_end_split_from_its_line_across_reads_is_found() {
        let mut decoder = SseDecoder::default();
        assert!(decoder.push(b"data: ab").unwrap().is_empty());
        assert!(decoder.push(b"cd\r").unwrap().is_empty());
        assert!(decoder.push(b"\n").unwrap().is_empty());
        assert_eq!(decoder.push(b"\r\ndata: e\n\n").unwrap(), vec!["abcd", "e"]);
    }

    #[test]
    fn an_event_that_never_ends_is_refused_once_too_large() {
        let mut decoder = SseDecoder::default();
        let piece = vec![b'x'; 1 << 20];
        assert!(decoder.push(b"data: ").is_ok());
        let mut refused = false;
        for _ in 0..=(MAX_EVENT_BYTES >> 20) {
            if decoder.push(&piece).is_err() {
                refused = true;
                break;
            }
        }
        assert!(refused, "one unfinished line");
        // Many complete data lines of one event that never ends count too.
        let mut decoder = SseDecoder::default();
        let mut line = b"data: ".to_vec();
        line.extend_from_slice(&piece);
        line.push(b'\n');
        let refused = (0..=(MAX_EVENT_BYTES >> 20)).any(|_| decoder.push(&line).is_err());
        assert!(refused, "many data lines");
        // Events that end are never refused, however many pass.
        let mut decoder = SseDecoder::default();
        let mut event = line.clone();
        event.push(b'\n');
        for _ in 0..(2 * (MAX_EVENT_BYTES >> 20)) {
            assert_eq!(decoder.push(&event).unwrap().len(), 1);
        }
    }
}
