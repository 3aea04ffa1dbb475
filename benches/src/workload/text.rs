//! Deterministic filler text: lowercase pseudo-words of 2..=10 letters separated by single spaces.
//!
//! The simulator's tokenizer makes one token of every such word, so a text of `n` words is exactly
//! `n` tokens. Words never contain `_`, so they never mention a tool (tool names here all do).

/// Consonants and vowels the pseudo-words are built from (syllables `cv` or `cvc`).
const CONSONANTS: &[u8] = b"bcdfghklmnprstvwz";
const VOWELS: &[u8] = b"aeiou";

/// Append one pseudo-word (2..=10 letters) to `out`.
fn push_word(rng: &mut fastrand::Rng, out: &mut String) {
    let syllables = match rng.u8(0..10) {
        0..=3 => 1,
        4..=7 => 2,
        _ => 3,
    };
    for _ in 0..syllables {
        out.push(CONSONANTS[rng.usize(..CONSONANTS.len())] as char);
        out.push(VOWELS[rng.usize(..VOWELS.len())] as char);
        if rng.u8(0..3) == 0 {
            out.push(CONSONANTS[rng.usize(..CONSONANTS.len())] as char);
        }
    }
}

/// Size of the pseudo-word vocabulary.
pub const VOCABULARY_SIZE: usize = 8192;

/// The vocabulary: [`VOCABULARY_SIZE`] pseudo-words built once from a fixed seed.
fn vocabulary() -> &'static [String] {
    static VOCABULARY: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    VOCABULARY.get_or_init(|| {
        let mut rng = fastrand::Rng::with_seed(0x0057_4f52_4453);
        (0..VOCABULARY_SIZE)
            .map(|_| {
                let mut word = String::with_capacity(10);
                push_word(&mut rng, &mut word);
                word
            })
            .collect()
    })
}

/// `count` pseudo-words drawn from `rng`, separated by single spaces (empty for 0).
pub fn words(rng: &mut fastrand::Rng, count: usize) -> String {
    let vocabulary = vocabulary();
    let mut out = String::with_capacity(count * 7);
    for index in 0..count {
        if index > 0 {
            out.push(' ');
        }
        if let Some(word) = vocabulary.get(rng.usize(..vocabulary.len())) {
            out.push_str(word);
        }
    }
    out
}

/// `count` pseudo-words that depend only on `seed` (equal seeds give equal text).
pub fn seeded_words(seed: u64, count: usize) -> String {
    words(&mut fastrand::Rng::with_seed(seed), count)
}

/// Mix two values into one well-spread seed (splitmix64 finalizer over their combination).
pub fn mix_seed(a: u64, b: u64) -> u64 {
    let mut z = a ^ b.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Number of whitespace-separated words in `text`.
pub fn word_count(text: &str) -> usize {
    text.split_whitespace().count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn n_words_are_n_simulator_tokens() {
        let text = seeded_words(7, 500);
        assert_eq!(word_count(&text), 500);
        assert_eq!(agentgate_sim::tokenizer::tokenize(&text).len(), 500);
        assert!(text
            .split(' ')
            .all(|w| (2..=12).contains(&w.len()) && w.bytes().all(|b| b.is_ascii_lowercase())));
        assert!(words(&mut fastrand::Rng::with_seed(1), 0).is_empty());
    }

    #[test]
    fn equal_seeds_give_equal_text_and_different_seeds_differ() {
        assert_eq!(seeded_words(3, 100), seeded_words(3, 100));
        assert_ne!(seeded_words(3, 100), seeded_words(4, 100));
        assert_ne!(mix_seed(1, 2), mix_seed(2, 1));
    }
}
