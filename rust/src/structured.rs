//! Structured output's grammar engine (llguidance): a row's `response_format` compiled into a
//! grammar, and a matcher per row that says which tokens may come next.
//!
//! - `response_format`: the request as OpenAI spells it (`json_schema`, `json_object`) plus
//!   `regex`, `grammar` (Lark) and `choice`, parsed strictly; a format that does not compile is
//!   the row's error, naming the reason.
//! - `token_env`: the tokenizer's vocabulary as the bytes each token stands for (byte-level BPE
//!   and SentencePiece-style vocabularies), which llguidance's token trie is built from.
//! - `matcher`: `Grammars` compiles each distinct format once (keyed by its canonical text) and
//!   hands out `RowMatcher`s, deep clones of the compiled prototype; a `RowMatcher` packs its
//!   token mask into u32 words (bit `t % 32` of word `t / 32` set: token t allowed), consumes
//!   committed tokens, validates drafts, rolls back and proposes the tokens the grammar forces.
//!
//! Invariant: a mask has the model's vocabulary width; ids the tokenizer does not define (a
//! checkpoint's padding rows) are never allowed.

mod language;
mod matcher;
mod response_format;
pub(crate) mod token_env;

pub use matcher::{Grammars, RowMatcher, MOST_ALTERNATIVES};
pub use response_format::{ResponseFormat, JSON_WHITESPACE};
pub use token_env::token_env;

/// Whether the JSON text of a job's response_format compiles for the tokenizer at `path`
/// (the model's `vocab_size` and EOS ids); the user error names the reason.
pub fn check_job_format(
    text: &str,
    path: &std::path::Path,
    vocab_size: usize,
    eos: &[u32],
) -> crate::error::Result<()> {
    use crate::error::Error;
    if text.trim().is_empty() {
        return Ok(()); // no format
    }
    let user = |e: String| Error::user(format!("sampling.{e}"));
    let Some(format) = ResponseFormat::parse_request(text).map_err(user)? else {
        return Ok(());
    };
    let tok = tokenizers::Tokenizer::from_file(path)
        .map_err(|e| Error::user(format!("cannot load tokenizer {}: {e}", path.display())))?;
    let vocab = vocab_size.max(tok.get_vocab_size(true));
    let grammars = Grammars::new(&token_env(&tok, vocab, eos)?, vocab)?;
    grammars.matcher(&format).map(drop).map_err(user)
}

#[cfg(test)]
mod tests;
