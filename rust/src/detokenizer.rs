//! Incremental detokenization (the "prefix offset / read offset" technique of TGI and vLLM).
//!
//! Decoding one token at a time is wrong for byte-level BPE (a character may span tokens) and
//! for decoders that treat the first token specially (SentencePiece's leading space), so each
//! step decodes a small window: `ids[prefix_offset..]` and `ids[prefix_offset..read_offset]`;
//! the new text is the difference. Text ending in U+FFFD (an incomplete UTF-8 sequence) is held
//! back until the next token completes it.
//!
//! Invariant: the concatenation of all returned deltas is a prefix of
//! `tokenizer.decode(ids, skip_special_tokens)` for the usual decoders; the scheduler
//! still re-decodes the full output once when a request finishes, so the final `output_text`
//! equals that decode exactly (unless a stop string cut it).

use tokenizers::Tokenizer;

use crate::error::{Error, Result};

#[derive(Debug, Default, Clone)]
pub struct IncrementalDetokenizer {
    /// Start of the decode window (tokens before it are already final text).
    prefix_offset: usize,
    /// Tokens in `[prefix_offset, read_offset)` have been emitted as text.
    read_offset: usize,
}

impl IncrementalDetokenizer {
    pub fn new() -> Self {
        Self::default()
    }

    /// `ids` are all output ids so far, including the ones just appended (EOS never included),
    /// decoded without special tokens when `skip_special_tokens`. Returns the text that became
    /// final with them (possibly empty).
    pub fn step(
        &mut self,
        tokenizer: &Tokenizer,
        ids: &[u32],
        skip_special_tokens: bool,
    ) -> Result<String> {
        if ids.len() <= self.read_offset {
            return Ok(String::new());
        }
        let decode = |s: &[u32]| {
            tokenizer
                .decode(s, skip_special_tokens)
                .map_err(|e| Error::Tokenizer(format!("decode failed: {e}")))
        };
        let prefix_text = decode(&ids[self.prefix_offset..self.read_offset])?;
        let new_text = decode(&ids[self.prefix_offset..])?;
        if new_text.len() > prefix_text.len() && !new_text.ends_with('\u{FFFD}') {
            if let Some(delta) = new_text.get(prefix_text.len()..) {
                let delta = delta.to_string();
                self.prefix_offset = self.read_offset;
                self.read_offset = ids.len();
                return Ok(delta);
            }
        }
        Ok(String::new())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::testutil::{byte_level_tokenizer, word_level_tokenizer};

    fn incremental(tok: &Tokenizer, ids: &[u32]) -> String {
        let mut d = IncrementalDetokenizer::new();
        let mut out = String::new();
        for n in 1..=ids.len() {
            out.push_str(&d.step(tok, &ids[..n], true).unwrap());
        }
        out
    }

    #[test]
    fn word_level_matches_full_decode() {
        let tok = word_level_tokenizer(50);
        let ids: Vec<u32> = vec![5, 6, 7, 8, 9];
        assert_eq!(incremental(&tok, &ids), tok.decode(&ids, true).unwrap());
    }

    #[test]
    fn special_tokens_are_skipped() {
        let tok = word_level_tokenizer(50);
        // id 2 is the special <eos> token of the test vocabulary.
        let ids: Vec<u32> = vec![5, 2, 6];
        let text = incremental(&tok, &ids);
        assert_eq!(text, tok.decode(&ids, true).unwrap());
        assert!(!text.contains("<eos>"));
    }

    #[test]
    fn byte_level_multibyte_characters_are_held_back_until_complete() {
        let tok = byte_level_tokenizer();
        let text = "héllo wörld, 日本語 🦀!";
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        assert!(ids.len() > text.chars().count(), "expect byte-level pieces");
        let mut d = IncrementalDetokenizer::new();
        let mut out = String::new();
        for n in 1..=ids.len() {
            let delta = d.step(&tok, &ids[..n], true).unwrap();
            assert!(!delta.contains('\u{FFFD}'), "emitted a partial character");
            out.push_str(&delta);
        }
        assert_eq!(out, text);
        assert_eq!(out, tok.decode(&ids, true).unwrap());
    }
}
