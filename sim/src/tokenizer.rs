//! The deterministic tokenizer: text -> pieces -> token ids.
//!
//! A *piece* is any leading whitespace followed by either a run of up to [`MAX_WORD_CHARS`]
//! letters/digits/underscores or one other character. Each piece is one token; its id is
//! `xxh3_64(piece without leading whitespace) % VOCAB_SIZE`. So "Hello, world!" is 4 tokens
//! (`Hello` `,` `world` `!`), and a gateway can estimate token counts as
//! "words + punctuation marks, long words split every 12 characters".
//! Concatenating the pieces of a text gives the text back exactly, which is how generated output
//! is streamed one token per chunk.
//!
//! Whitespace never changes an id, so tokenizing `a + b` gives the tokens of `a` followed by those
//! of `b` unless a word runs across the seam (`a` ends and `b` starts with a letter, digit or `_`).
//! The generator relies on this: the output it plans piece by piece retokenizes, inside the next
//! turn's prompt, to the same ids.

/// Size of the simulated vocabulary; token ids are below this.
pub const VOCAB_SIZE: u64 = 151_936;

/// Longest run of word characters that forms one piece.
pub const MAX_WORD_CHARS: usize = 12;

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Split `text` into pieces whose concatenation is `text` (trailing whitespace joins the last piece).
pub fn split_pieces(text: &str) -> Vec<&str> {
    let mut pieces = Vec::new();
    let mut start = 0;
    let mut chars = text.char_indices().peekable();
    while let Some(&(_, c)) = chars.peek() {
        // leading whitespace belongs to the piece that follows it
        if c.is_whitespace() {
            chars.next();
            continue;
        }
        let (_, first) = chars.next().unwrap_or((0, c));
        if is_word_char(first) {
            let mut count = 1;
            while let Some(&(_, next)) = chars.peek() {
                if is_word_char(next) && count < MAX_WORD_CHARS {
                    chars.next();
                    count += 1;
                } else {
                    break;
                }
            }
        }
        let end = chars.peek().map(|&(i, _)| i).unwrap_or(text.len());
        pieces.push(&text[start..end]);
        start = end;
    }
    if start < text.len() {
        match pieces.last_mut() {
            Some(last) => {
                let last_start = text.len() - (last.len() + (text.len() - start));
                *last = &text[last_start..];
            }
            None => pieces.push(&text[start..]),
        }
    }
    pieces
}

/// Token id of one piece (surrounding whitespace ignored, so a piece's id does not depend on
/// whether it ends its text).
pub fn piece_id(piece: &str) -> u32 {
    let trimmed = piece.trim();
    (xxhash_rust::xxh3::xxh3_64(trimmed.as_bytes()) % VOCAB_SIZE) as u32
}

/// Tokenize `text` into token ids (whitespace-only text has no tokens).
pub fn tokenize(text: &str) -> Vec<u32> {
    split_pieces(text)
        .into_iter()
        .filter(|piece| !piece.trim().is_empty())
        .map(piece_id)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_concatenate_back_to_the_text() {
        let text = "  Hello, world!  fn main() { let x_1 = 42; }\n\n";
        let pieces = split_pieces(text);
        assert_eq!(pieces.concat(), text);
        assert_eq!(tokenize("Hello, world!").len(), 4);
    }

    #[test]
    fn long_words_split_and_ids_are_stable() {
        assert_eq!(tokenize("abcdefghijklmnopqrstuvwxyz").len(), 3);
        assert_eq!(tokenize("same words"), tokenize("same   words"));
        assert_ne!(tokenize("alpha"), tokenize("beta"));
        assert!(tokenize("   ").is_empty());
    }

    #[test]
    fn text_tokenizes_piecewise_when_no_word_runs_across_the_seam() {
        let parts = [
            "<|im_start|>assistant\n",
            "<think>",
            "Thinking: cache block.",
            "</think>\n",
            "Works here.",
            " and then",
            "\n<tool_call>{\"name\":\"read_file\",\"arguments\":",
            "{\"path\":\"abcdefghijklmnopqrstuvwxyz\",\"n\":42}",
            "}</tool_call>",
            "<|im_end|>\n",
        ];
        let whole: Vec<u32> = tokenize(&parts.concat());
        let piecewise: Vec<u32> = parts.iter().flat_map(|part| tokenize(part)).collect();
        assert_eq!(whole, piecewise);
        let from_pieces: Vec<u32> = parts
            .iter()
            .flat_map(|part| split_pieces(part))
            .map(piece_id)
            .collect();
        assert_eq!(whole, from_pieces);
        assert_eq!(piece_id(">\n"), piece_id(">"));
        assert_ne!(
            tokenize("ab").len(),
            [tokenize("a"), tokenize("b")].concat().len()
        );
    }
}
