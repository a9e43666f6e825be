//! The vocabulary as bytes, for llguidance's token trie (`toktrie`), from the tokenizer itself.
//!
//! Each id's bytes: a byte-level BPE token's characters mapped back through GPT-2's byte
//! alphabet; a SentencePiece-style token's text with `▁` as a space and `<0xNN>` as byte NN; an
//! added token's own text; a special token (or an id the tokenizer does not define, up to the
//! model's vocabulary size) the special marker and its name, which grammar text never matches.

use std::collections::HashMap;
use std::sync::Arc;

use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use tokenizers::Tokenizer;

use crate::error::{Error, Result};

/// The token environment of `tok` over `vocab_size` ids (the model's, >= the tokenizer's).
/// `eos`: the ids that end a row; with none, one id past the vocabulary stands for EOS (never
/// produced, never in a mask).
pub fn token_env(tok: &Tokenizer, vocab_size: usize, eos: &[u32]) -> Result<TokEnv> {
    let words = token_bytes(tok, vocab_size)?;
    let mut words = words;
    let eos: Vec<u32> = if eos.is_empty() {
        words.push(special(&format!("<virtual eos {}>", words.len())));
        vec![words.len() as u32 - 1]
    } else {
        eos.to_vec()
    };
    let info = TokRxInfo::new(words.len() as u32, eos[0]);
    let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
    Ok(Arc::new(Env {
        tok: tok.clone(),
        trie,
    }))
}

/// The bytes of every id below `vocab_size`.
fn token_bytes(tok: &Tokenizer, vocab_size: usize) -> Result<Vec<Vec<u8>>> {
    let added: HashMap<u32, (String, bool)> = tok
        .get_added_tokens_decoder()
        .into_iter()
        .map(|(id, t)| (id, (t.content, t.special)))
        .collect();
    let byte_level = serde_json::to_string(&tok.get_decoder())
        .map(|d| d.contains("ByteLevel"))
        .unwrap_or(false);
    let alphabet = byte_alphabet();
    let n = vocab_size.max(tok.get_vocab_size(true));
    let mut words = Vec::with_capacity(n);
    for id in 0..n as u32 {
        let bytes = match (added.get(&id), tok.id_to_token(id)) {
            (Some((name, true)), _) => special(name),
            (Some((text, false)), _) => text.as_bytes().to_vec(),
            (None, Some(piece)) if byte_level => {
                from_byte_level(&piece, &alphabet).ok_or_else(|| {
                    Error::Tokenizer(format!("token {id} {piece:?} is not byte-level"))
                })?
            }
            (None, Some(piece)) => from_sentencepiece(&piece),
            (None, None) => special(&format!("<unused {id}>")),
        };
        words.push(bytes);
    }
    Ok(words)
}

fn special(name: &str) -> Vec<u8> {
    let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
    b.extend_from_slice(name.as_bytes());
    b
}

/// GPT-2's byte alphabet inverted: printable Latin-1 characters stand for themselves, the other
/// 68 bytes for U+0100.. in byte order.
fn byte_alphabet() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (b as char, b)
            } else {
                next += 1;
                (char::from_u32(next - 1).expect("U+0100..U+0143"), b)
            }
        })
        .collect()
}

fn from_byte_level(piece: &str, alphabet: &HashMap<char, u8>) -> Option<Vec<u8>> {
    piece.chars().map(|c| alphabet.get(&c).copied()).collect()
}

/// `▁` is a space; `<0xNN>` (byte fallback) is the byte NN.
fn from_sentencepiece(piece: &str) -> Vec<u8> {
    let hex = piece.strip_prefix("<0x").and_then(|h| h.strip_suffix('>'));
    if let Some(byte) = hex
        .filter(|h| h.len() == 2)
        .and_then(|h| u8::from_str_radix(h, 16).ok())
    {
        return vec![byte];
    }
    piece.replace('\u{2581}', " ").into_bytes()
}

struct Env {
    tok: Tokenizer,
    trie: TokTrie,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// The tokenizer's own ids for text (forced tokens are then the ones a prompt would have),
    /// the trie's greedy match for bytes that are not UTF-8.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tok
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        })
    }
}

#[cfg(test)]
pub(crate) fn from_sentencepiece_for_tests(piece: &str) -> Vec<u8> {
    from_sentencepiece(piece)
}
