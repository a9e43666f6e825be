//! Compiled grammars, once per distinct format, and one matcher per row.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use llguidance::toktrie::TokEnv;
use llguidance::{Matcher, ParserFactory};

use super::ResponseFormat;
use crate::error::{Error, Result};

/// The most distinct formats kept compiled; past it the cache starts over (a job with more
/// distinct schemas than this compiles some twice, never holds more).
const MOST_CACHED: usize = 1024;

/// A tokenizer's grammar compiler and its cache of compiled formats.
pub struct Grammars {
    factory: ParserFactory,
    vocab_size: usize,
    // format key -> the compiled prototype (rows get deep clones), or why it does not compile
    cache: Mutex<HashMap<String, std::result::Result<Matcher, String>>>,
    compiled: AtomicUsize,
}

impl Grammars {
    /// `vocab_size`: the model's; masks are that wide.
    pub fn new(env: &TokEnv, vocab_size: usize) -> Result<Self> {
        let mut factory = ParserFactory::new_simple(env)
            .map_err(|e| Error::internal(format!("grammar compiler: {e}")))?;
        factory.set_stderr_log_level(0);
        Ok(Grammars {
            factory,
            vocab_size,
            cache: Mutex::new(HashMap::new()),
            compiled: AtomicUsize::new(0),
        })
    }

    /// A fresh matcher for `format` at the start of a row's output; Err: why the format does
    /// not compile (the row's error).
    pub fn matcher(&self, format: &ResponseFormat) -> std::result::Result<RowMatcher, String> {
        let key = format.key();
        let mut cache = self.cache.lock().expect("grammar cache");
        if !cache.contains_key(&key) {
            if cache.len() >= MOST_CACHED {
                cache.clear();
            }
            self.compiled.fetch_add(1, Ordering::Relaxed);
            cache.insert(key.clone(), self.compile(format));
        }
        let prototype = cache[&key].as_ref().map_err(Clone::clone)?;
        Ok(RowMatcher {
            matcher: prototype.deep_clone(),
            vocab_size: self.vocab_size,
        })
    }

    fn compile(&self, format: &ResponseFormat) -> std::result::Result<Matcher, String> {
        let matcher = Matcher::new(self.factory.create_parser(format.grammar()));
        match matcher.get_error() {
            None => Ok(matcher),
            Some(e) => Err(format!("response_format does not compile: {e}")),
        }
    }

    /// How many formats were compiled so far (cache misses).
    pub fn compiled(&self) -> usize {
        self.compiled.load(Ordering::Relaxed)
    }

    /// u32 words of one mask.
    pub fn mask_words(&self) -> usize {
        self.vocab_size.div_ceil(32)
    }
}

/// One row's position in its grammar.
pub struct RowMatcher {
    matcher: Matcher,
    vocab_size: usize,
}

impl std::fmt::Debug for RowMatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowMatcher")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl RowMatcher {
    /// An independent copy at the same position (each of a row's samples gets its own).
    pub fn fork(&self) -> RowMatcher {
        RowMatcher {
            matcher: self.matcher.deep_clone(),
            vocab_size: self.vocab_size,
        }
    }

    /// The tokens allowed next, packed into `out` (`mask_words` u32: bit t % 32 of word t / 32);
    /// EOS is allowed where the grammar may end, and is all a stopped grammar allows. Ids at or
    /// past the model's vocabulary are not.
    pub fn fill_mask(&mut self, out: &mut [u32]) -> Result<()> {
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| self.error(e))?;
        let words = mask.as_slice();
        let n = out.len().min(words.len());
        out[..n].copy_from_slice(&words[..n]);
        out[n..].fill(0);
        let (full, rest) = (self.vocab_size / 32, self.vocab_size % 32);
        if full < out.len() {
            out[full] &= (1u32 << rest).wrapping_sub(1);
            out[full + 1..].fill(0);
        }
        Ok(())
    }

    /// Advances over committed tokens (each must be allowed).
    pub fn consume(&mut self, tokens: &[u32]) -> Result<()> {
        self.matcher
            .consume_tokens(tokens)
            .map_err(|e| self.error(e))
    }

    /// How many leading `drafts` the grammar accepts from here (the matcher does not move).
    pub fn valid_prefix(&mut self, drafts: &[u32]) -> usize {
        if self.matcher.is_stopped() {
            return 0; // nothing follows a completed grammar (an EOS would end the row)
        }
        self.matcher.validate_tokens(drafts).unwrap_or(0)
    }

    /// Takes back the last `n` consumed tokens.
    pub fn rollback(&mut self, n: usize) -> Result<()> {
        self.matcher.rollback(n).map_err(|e| self.error(e))
    }

    /// The tokens the grammar forces from here (its only continuation), maybe none.
    pub fn forced(&mut self) -> Vec<u32> {
        self.matcher.compute_ff_tokens()
    }

    /// The grammar admits no more tokens (it completed, or consumed EOS).
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// The output so far is a complete match (EOS may come now).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    fn error(&self, e: impl std::fmt::Display) -> Error {
        Error::internal(format!("structured output: {e}"))
    }
}
