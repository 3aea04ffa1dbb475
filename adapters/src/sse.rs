//! Incremental decoder for `text/event-stream` bodies: bytes in, `data:` payloads out.
//!
//! Handles `\n` and `\r\n` line ends, multi-line `data:` fields (joined with `\n`), comment lines
//! and fields other than `data` (ignored), and payloads split across network reads.

/// Accumulates bytes and yields the data payload of each complete event.
#[derive(Debug, Default)]
pub(crate) struct SseDecoder {
    buffer: Vec<u8>,
    data_lines: Vec<String>,
}

impl SseDecoder {
    /// Feeds bytes; returns the payloads of the events completed by them.
    pub(crate) fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buffer.extend_from_slice(bytes);
        let mut payloads = Vec::new();
        while let Some(newline) = self.buffer.iter().position(|b| *b == b'\n') {
            let mut line: Vec<u8> = self.buffer.drain(..=newline).collect();
            line.pop();
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            let line = String::from_utf8_lossy(&line);
            self.handle_line(&line, &mut payloads);
        }
        payloads
    }

    /// Flushes an event left open at end of stream (no trailing blank line).
    pub(crate) fn finish(&mut self) -> Option<String> {
        if !self.buffer.is_empty() {
            let rest = std::mem::take(&mut self.buffer);
            let line = String::from_utf8_lossy(&rest)
                .trim_end_matches('\r')
                .to_string();
            let mut payloads = Vec::new();
            self.handle_line(&line, &mut payloads);
            if let Some(payload) = payloads.pop() {
                return Some(payload);
            }
        }
        if self.data_lines.is_empty() {
            None
        } else {
            Some(std::mem::take(&mut self.data_lines).join("\n"))
        }
    }

    fn handle_line(&mut self, line: &str, payloads: &mut Vec<String>) {
        if line.is_empty() {
            if !self.data_lines.is_empty() {
                payloads.push(std::mem::take(&mut self.data_lines).join("\n"));
            }
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
            self.data_lines.push(value.to_string());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_split_events_and_crlf() {
        let mut decoder = SseDecoder::default();
        assert!(decoder.push(b"data: {\"a\"").is_empty());
        assert_eq!(
            decoder.push(b":1}\n\n: keepalive\n\ndata: x\r\n\r\n"),
            vec!["{\"a\":1}", "x"]
        );
        assert_eq!(
            decoder.push(b"event: e\ndata: l1\ndata: l2\n\ndata: [DONE]"),
            vec!["l1\nl2"]
        );
        assert_eq!(decoder.finish().as_deref(), Some("[DONE]"));
        assert_eq!(decoder.finish(), None);
    }

    #[test]
    fn multibyte_characters_split_across_reads_survive() {
        let mut decoder = SseDecoder::default();
        let bytes = "data: héllo\n\n".as_bytes();
        let (a, b) = bytes.split_at(8);
        assert!(decoder.push(a).is_empty());
        assert_eq!(decoder.push(b), vec!["héllo"]);
    }
}
