//! Compiled grammars, once per distinct format, and one matcher per row.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use std::panic::{catch_unwind, AssertUnwindSafe};

use llguidance::api::StopReason;
use llguidance::toktrie::{SimpleVob, TokEnv};
use llguidance::{Matcher, ParserFactory, TokenParser};

use super::{language, ResponseFormat};
use crate::error::{Error, Result};

/// The most distinct formats kept compiled; past it the cache starts over (a job with more
/// distinct schemas than this compiles some twice, never holds more).
const MOST_CACHED: usize = 1024;

/// The most alternatives one point of a format may offer: a choice's entries, a Lark
/// alternation, a JSON schema's anyOf / oneOf / enum (llguidance's Earley row limit, 2,000 by
/// default, raised to this). More is refused at compile time, a row's own format when its row
/// reaches them.
pub const MOST_ALTERNATIVES: usize = 10_000;
/// Earley items the rules around an alternation add to its row.
const ROW_SLACK: usize = 64;
/// The most characters of an llguidance error a message quotes.
const MOST_QUOTED: usize = 200;

const EMPTY_LANGUAGE: &str = "response_format matches no text at all (its language is empty: \
    a rule or $ref that only refers to itself, or a pattern no string matches)";

/// A tokenizer's grammar compiler and its cache of compiled formats.
pub struct Grammars {
    factory: ParserFactory,
    vocab_size: usize,
    eos: SimpleVob, // the tokenizer's EOS ids

    // format key -> the compiled prototype (rows get deep clones), or why it does not compile
    cache: Mutex<HashMap<String, std::result::Result<Compiled, String>>>,
    compiled: AtomicUsize,
}

/// A compiled format: its matcher at the start of a row, and whether the start allows nothing
/// but the end (the format matches only the empty text).
struct Compiled {
    matcher: Matcher,
    only_end: bool,
}

impl Grammars {
    /// `vocab_size`: the model's; masks are that wide.
    pub fn new(env: &TokEnv, vocab_size: usize) -> Result<Self> {
        let mut factory = ParserFactory::new_simple(env)
            .map_err(|e| Error::internal(format!("grammar compiler: {e}")))?;
        factory.set_stderr_log_level(0);
        let limits = factory.limits_mut();
        limits.max_items_in_row = MOST_ALTERNATIVES + ROW_SLACK;
        limits.step_max_items = limits.step_max_items.max(10 * MOST_ALTERNATIVES);
        limits.verbose_errors = false; // errors are messages in rows: no state dumps
        Ok(Grammars {
            factory,
            vocab_size,
            eos: env.tok_trie().eos_token_set(),
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
            matcher: prototype.matcher.deep_clone(),
            vocab_size: self.vocab_size,
            only_end: prototype.only_end,
            consumed: 0,
        })
    }

    /// Compiles `format` and checks its start: Err says why no row could follow it (it does not
    /// compile, offers too many alternatives, or matches no text).
    fn compile(&self, format: &ResponseFormat) -> std::result::Result<Compiled, String> {
        if let ResponseFormat::Choice(choices) = format {
            if choices.len() > MOST_ALTERNATIVES {
                return Err(too_many(choices.len()));
            }
        }
        let parser = self
            .factory
            .create_parser(format.grammar())
            .map_err(|e| failure(&e.to_string()))?;
        if language::is_empty(parser.parser.grammar()) {
            return Err(EMPTY_LANGUAGE.to_string());
        }
        let mut parser = parser;
        if parser.is_fresh() {
            parser.start_without_prompt();
        }
        let only_end = self.only_end_at_start(&parser)?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(failure(&e));
        }
        Ok(Compiled { matcher, only_end })
    }

    /// Whether the start allows nothing but the end; Err: it allows nothing at all (the
    /// language is empty) or its mask fails (e.g. too many alternatives).
    fn only_end_at_start(&self, prototype: &TokenParser) -> std::result::Result<bool, String> {
        let mut p = prototype.deep_clone();
        let mask = catch_unwind(AssertUnwindSafe(|| p.compute_mask()))
            .map_err(|_| failure("the grammar engine failed at the start"))?;
        let mask = match mask {
            Ok(mask) => mask,
            Err(_) if p.stop_reason() == StopReason::NoExtensionBias => {
                return Err(EMPTY_LANGUAGE.to_string())
            }
            Err(e) => return Err(failure(&e.to_string())),
        };
        let text = mask
            .iter()
            .any(|t| (t as usize) < self.vocab_size && !self.eos.is_allowed(t));
        match (text, p.is_accepting()) {
            (true, _) => Ok(false),
            (false, true) => Ok(true),
            (false, false) => Err(EMPTY_LANGUAGE.to_string()),
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
    // the format's start allows only the end, and `consumed` tokens (committed or drafted) are
    // past the start
    only_end: bool,
    consumed: usize,
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
            only_end: self.only_end,
            consumed: self.consumed,
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
            .map_err(|e| self.error(e))?;
        self.consumed += tokens.len();
        Ok(())
    }

    /// How many leading `drafts` the grammar accepts from here (the matcher does not move).
    pub fn valid_prefix(&mut self, drafts: &[u32]) -> usize {
        if self.matcher.is_stopped() {
            return 0; // nothing follows a completed grammar (an EOS would end the row)
        }
        self.matcher.validate_tokens(drafts).unwrap_or(0)
    }

    /// Takes back the last `n` consumed tokens (nothing for a failed matcher: its failure is
    /// final, and its row's error).
    pub fn rollback(&mut self, n: usize) -> Result<()> {
        if n > 0 && !self.matcher.is_error() {
            self.matcher.rollback(n).map_err(|e| self.error(e))?;
        }
        self.consumed = self.consumed.saturating_sub(n);
        Ok(())
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

    /// The grammar allows nothing but its end from here: it completed, or the format matches
    /// only the empty text and nothing was consumed yet. Such a row ends (`stop`) without a
    /// token, as a completed grammar does, even below its `min_new_tokens`.
    pub fn only_ends(&self) -> bool {
        let completed = self.matcher.is_stopped() && !self.matcher.is_error();
        completed || (self.only_end && self.consumed == 0)
    }

    /// Why the matcher failed (a mask it could not compute), in a row's words; None while it
    /// works.
    pub fn failure(&self) -> Option<String> {
        self.matcher.get_error().map(|e| match alternatives(&e) {
            Some(n) => too_many(n),
            None => format!(
                "response_format failed at this point of the output: {}",
                quote(&e)
            ),
        })
    }

    fn error(&self, e: impl std::fmt::Display) -> Error {
        Error::internal(format!("structured output: {}", quote(&e.to_string())))
    }
}

/// A format that does not compile, in words (llguidance's first line, at most `MOST_QUOTED`
/// characters: no grammar or state dumps).
fn failure(e: &str) -> String {
    match alternatives(e) {
        Some(n) => too_many(n),
        None => format!("response_format does not compile: {}", quote(e)),
    }
}

fn too_many(n: usize) -> String {
    format!(
        "response_format offers {n} alternatives at one point; at most {MOST_ALTERNATIVES} are \
         supported (a choice's entries, a Lark alternation, a JSON schema's anyOf, oneOf or enum)"
    )
}

/// The alternatives of an llguidance row-limit error ("Current row has N items; max is M").
fn alternatives(e: &str) -> Option<usize> {
    let rest = e.split("Current row has ").nth(1)?;
    let n: String = rest.chars().take_while(char::is_ascii_digit).collect();
    rest[n.len()..]
        .starts_with(" items; max is")
        .then(|| n.parse().ok())
        .flatten()
}

fn quote(e: &str) -> String {
    let line = e
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("");
    match line.char_indices().nth(MOST_QUOTED) {
        Some((cut, _)) => format!("{}...", &line[..cut]),
        None => line.to_string(),
    }
}
