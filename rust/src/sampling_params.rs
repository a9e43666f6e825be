//! Per-request sampling parameters: the job's `sampling` section
//! (`RunConfig::sampling_params`), with a row's values from the input columns named by
//! `sampling_columns` overriding it (a null falls back to the job's; reader/columns.rs reads
//! them) or an OpenAI Batch line's body (openai_batch.rs).
//!
//! One rule checks them (`SamplingParams::check`): the job's settings once, up front, and every
//! row's overrides as the row is read; a row whose values fail it becomes an error row naming
//! the column. Each key's range is stated once (`RANGES`): the job schema holds its keys to
//! it through the extension (`sampling_rule`), and row values meet it before they become f32s. The scheduler reads its stop conditions from here, the plan its per-row arrays.
//! A domain type: this module reads neither the config nor Arrow.

use std::sync::Arc;

use crate::structured::ResponseFormat;

/// The most top-logprob alternatives a request may ask for (vLLM's default limit).
pub const MAX_LOGPROBS: u32 = 20;

/// The smallest positive `temperature` and the smallest `repetition_penalty` (`RANGES`):
/// logits divided by less overflow f32 and crash the sampler.
pub const SAMPLING_MIN: f32 = 1e-5;

/// The largest `temperature` and `repetition_penalty`.
pub const SAMPLING_MAX: f32 = 1e6;

/// `Default` is every field's zero (for the crate's tests' configs; a run's are read whole).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SamplingParams {
    pub max_new_tokens: usize,
    /// EOS and stop token ids are masked (and stop strings not checked) before this many
    /// output tokens.
    pub min_new_tokens: usize,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: i32,
    /// The row's own seed (from a seed column); None: derived from the job seed and row index.
    pub seed: Option<i64>,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// Non-empty stop strings.
    pub stop: Vec<String>,
    /// Top alternatives per output token in the `logprobs` column (0 = none).
    pub logprobs: u32,
    /// vLLM's min-p (0 = off): the worker keeps the tokens whose probability after temperature
    /// is at least `min_p` times the most likely one's.
    pub min_p: f32,
    /// Do not stop at the model's EOS ids (`stop_token_ids` still stop).
    pub ignore_eos: bool,
    /// Ids that end the request like EOS (counted as an output token, not in the text).
    pub stop_token_ids: Vec<u32>,
    /// The text keeps the stop string that ended it.
    pub include_stop_str_in_output: bool,
    /// Decode the text without special tokens (false: they appear in it).
    pub skip_special_tokens: bool,
    /// The model's vocabulary size, the job's (no row sets it): every stop token id is below
    /// it (0: unchecked).
    pub vocab_size: usize,
    /// Samples of the row (`sampling.n`, or an OpenAI Batch line's `n`), 1..=`MAX_SAMPLES`.
    pub n: usize,
    /// What the output must match (structured output), if anything: the job's
    /// `sampling.response_format`, a row's column or a batch line's body.
    pub response_format: Option<Arc<ResponseFormat>>,
}

/// The most samples of one row; resume keys a row's samples `row_index * MAX_SAMPLES +
/// sample_index` (py/eaglebatch/output/resume.py `SAMPLE_STRIDE`), whatever each row's n.
pub const MAX_SAMPLES: usize = 4096;

/// Keys `sampling_columns` may map (reader/columns.rs reads each by its kind).
pub const COLUMN_KEYS: [&str; 17] = [
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "stop",
    "logprobs",
    "min_p",
    "ignore_eos",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "response_format",
];

impl SamplingParams {
    /// Why the parameters are invalid (naming the key), if they are.
    pub fn check(&self) -> Result<(), String> {
        match self.violation() {
            Some((_, msg)) => Err(msg),
            None => Ok(()),
        }
    }

    /// The first rule the parameters break: the keys it involves and the message (naming
    /// them). Every float is finite, and a nonzero one a normal f32 (never subnormal).
    pub(crate) fn violation(&self) -> Option<(&'static [&'static str], String)> {
        self.length_violation()
            .or_else(|| self.float_violation())
            .or_else(|| self.integer_violation())
    }

    fn length_violation(&self) -> Option<(&'static [&'static str], String)> {
        if let Some(what) = range_violation("max_new_tokens", self.max_new_tokens as f64) {
            let msg = format!("max_new_tokens {what}, got {}", self.max_new_tokens);
            return Some((&["max_new_tokens"], msg));
        }
        if self.min_new_tokens > self.max_new_tokens {
            let msg = format!(
                "min_new_tokens ({}) must be <= max_new_tokens ({})",
                self.min_new_tokens, self.max_new_tokens
            );
            return Some((&["min_new_tokens", "max_new_tokens"], msg));
        }
        None
    }

    fn float_violation(&self) -> Option<(&'static [&'static str], String)> {
        let values = [
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("repetition_penalty", self.repetition_penalty),
            ("min_p", self.min_p),
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ];
        values.into_iter().find_map(|(key, v)| {
            let range = range_of(key)?;
            let subnormal = v != 0.0 && !v.is_normal();
            let what = range_violation(key, f64::from(v)).or(subnormal.then_some(range.what))?;
            Some((range.keys, format!("{key} {what}, got {}", num(v))))
        })
    }

    fn integer_violation(&self) -> Option<(&'static [&'static str], String)> {
        if let Some(what) = range_violation("top_k", f64::from(self.top_k)) {
            return Some((&["top_k"], format!("top_k {what}, got {}", self.top_k)));
        }
        let v = self.vocab_size;
        if let Some(t) = self
            .stop_token_ids
            .iter()
            .find(|&&t| v > 0 && t as usize >= v)
        {
            let msg = format!("stop_token_ids: {t} is not an id of the model (vocab_size {v})");
            return Some((&["stop_token_ids"], msg));
        }
        if let Some(what) = range_violation("logprobs", f64::from(self.logprobs)) {
            let msg = format!("logprobs {what}, got {}", self.logprobs);
            return Some((&["logprobs"], msg));
        }
        None
    }

    /// Whether any of the three penalties is on (the worker then needs the row's tokens).
    pub fn penalized(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
    }

    /// The longest stop string in bytes (0 when none): bounds the stop-string search.
    pub fn max_stop_len(&self) -> usize {
        self.stop.iter().map(String::len).max().unwrap_or(0)
    }
}

/// The range of one sampling key: the one statement of it, read by `SamplingParams::check`
/// (the job's values and every row's), by the readers of sampling columns and batch lines
/// before a value becomes an f32, and by the job schema through the extension
/// (py/eaglebatch/job/config.py `sampling_rule`).
pub struct Range {
    pub key: &'static str,
    /// The keys a message about this one names (for a row: the columns to blame).
    keys: &'static [&'static str],
    lo: f64,
    hi: f64,
    /// The lower bound itself is refused (`(lo, hi]`).
    open_lo: bool,
    /// 0 is accepted besides `[lo, hi]` (temperature: greedy).
    zero: bool,
    /// The range in words, as messages state it.
    what: &'static str,
}

const I32_MAX: f64 = i32::MAX as f64;

/// Every ranged sampling key. Floats are also finite and, when nonzero, normal f32s (`to_f32`).
pub const RANGES: &[Range] = &[
    Range {
        key: "temperature",
        keys: &["temperature"],
        lo: SAMPLING_MIN as f64,
        hi: SAMPLING_MAX as f64,
        open_lo: false,
        zero: true,
        what: "must be 0 (greedy) or a number in [1e-5, 1e6]",
    },
    Range {
        key: "top_p",
        keys: &["top_p"],
        lo: 0.0,
        hi: 1.0,
        open_lo: true,
        zero: false,
        what: "must be in (0, 1]",
    },
    Range {
        key: "repetition_penalty",
        keys: &["repetition_penalty"],
        lo: SAMPLING_MIN as f64,
        hi: SAMPLING_MAX as f64,
        open_lo: false,
        zero: false,
        what: "must be a number in [1e-5, 1e6] (1 = off)",
    },
    Range {
        key: "min_p",
        keys: &["min_p"],
        lo: 0.0,
        hi: 1.0,
        open_lo: false,
        zero: false,
        what: "must be in [0, 1] (0 = off)",
    },
    Range {
        key: "frequency_penalty",
        keys: &["frequency_penalty"],
        lo: -2.0,
        hi: 2.0,
        open_lo: false,
        zero: false,
        what: "must be in [-2, 2] (0 = off)",
    },
    Range {
        key: "presence_penalty",
        keys: &["presence_penalty"],
        lo: -2.0,
        hi: 2.0,
        open_lo: false,
        zero: false,
        what: "must be in [-2, 2] (0 = off)",
    },
    Range {
        key: "max_new_tokens",
        keys: &["max_new_tokens"],
        lo: 1.0,
        hi: I32_MAX,
        open_lo: false,
        zero: false,
        what: "must be in 1..=2147483647",
    },
    Range {
        key: "top_k",
        keys: &["top_k"],
        lo: 0.0,
        hi: I32_MAX,
        open_lo: false,
        zero: false,
        what: "must be in 0..=2147483647 (0 = off)",
    },
    Range {
        key: "logprobs",
        keys: &["logprobs"],
        lo: 0.0,
        hi: MAX_LOGPROBS as f64,
        open_lo: false,
        zero: false,
        what: "must be in 0..=20",
    },
    Range {
        key: "n",
        keys: &["n"],
        lo: 1.0,
        hi: MAX_SAMPLES as f64,
        open_lo: false,
        zero: false,
        what: "must be in 1..=4096",
    },
];

/// How `v` breaks `key`'s range, in words (None: in range, or `key` has none). NaN is out of
/// every range.
pub fn range_violation(key: &str, v: f64) -> Option<&'static str> {
    let r = range_of(key)?;
    let above_lo = if r.open_lo { v > r.lo } else { v >= r.lo };
    let ok = (r.zero && v == 0.0) || (above_lo && v <= r.hi);
    (!ok).then_some(r.what)
}

fn range_of(key: &str) -> Option<&'static Range> {
    RANGES.iter().find(|r| r.key == key)
}

/// A float key's value as the f32 it is held in: in its range (`RANGES`, judged on the value
/// given, so 1e-40 is refused by temperature's range rather than as an f32's loss), then
/// representable (`to_f32`).
pub fn held_f32(key: &str, v: f64) -> Result<f32, String> {
    if let Some(what) = range_violation(key, v) {
        return Err(format!("{key} {what}, got {}", num(v)));
    }
    to_f32(v)
}

/// `v` for a message: plain digits for ordinary magnitudes, exponent form for tiny or huge ones
/// (1e-40 rather than forty zeros).
pub(crate) fn num(v: impl Into<f64>) -> String {
    let v: f64 = v.into();
    if v != 0.0 && v.is_finite() && !(1e-4..1e7).contains(&v.abs()) {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

/// A row's seed as vLLM reads one: -1 is no seed of its own (the row is seeded by the job seed
/// and its row index), any other value (negative ones too, as their 64-bit patterns) is its
/// seed.
pub fn row_seed(v: i64) -> Option<i64> {
    (v != -1).then_some(v)
}

/// `v` as the f32 a float key holds; a nonzero value that f32 turns into 0, a subnormal or an
/// infinity is an error (NaN and infinities pass on, for `check` to refuse).
pub fn to_f32(v: f64) -> Result<f32, String> {
    let f = v as f32;
    let lost = f == 0.0 || f.is_subnormal() || f.is_infinite();
    if v != 0.0 && v.is_finite() && lost {
        return Err(format!(
            "{} is not representable as a 32-bit float (it would become {})",
            num(v),
            num(f)
        ));
    }
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RunConfig;
    use std::path::PathBuf;

    fn job() -> SamplingParams {
        RunConfig::new(vec![], "p", PathBuf::new(), PathBuf::new()).sampling_params()
    }

    #[test]
    fn one_range_per_key_judged_on_the_value_given() {
        assert_eq!(range_violation("temperature", 0.0), None);
        assert_eq!(range_violation("temperature", 1e-5_f32 as f64), None);
        for v in [-1.0, 5e-6, 1e-40, 2e6, f64::NAN, f64::INFINITY] {
            let what = range_violation("temperature", v).unwrap();
            assert!(what.contains("0 (greedy)") && what.contains("1e-5"), "{v}");
        }
        assert!(range_violation("top_p", 0.0).is_some() && range_violation("top_p", 1.0).is_none());
        assert!(
            range_violation("top_k", -1.0).is_some() && range_violation("top_k", 0.0).is_none()
        );
        assert!(range_violation("n", 4097.0).is_some() && range_violation("n", 4096.0).is_none());
        assert!(range_violation("logprobs", 21.0).is_some());
        assert!(range_violation("max_new_tokens", 0.0).is_some());
        assert_eq!(range_violation("seed", -5.0), None); // no range: any seed
                                                         // 1e-40 breaks temperature's range before it would be lost as an f32
        let e = held_f32("temperature", 1e-40).unwrap_err();
        assert!(e.starts_with("temperature must be 0 (greedy)"), "{e}");
        let e = held_f32("top_p", 1e-300).unwrap_err();
        assert!(e.contains("32-bit float"), "{e}");
        assert_eq!(held_f32("top_p", 0.5), Ok(0.5));
    }

    #[test]
    fn job_checks() {
        let mut p = job();
        assert!(p.check().is_ok() && !p.penalized());
        p.min_new_tokens = p.max_new_tokens + 1;
        assert!(p.check().unwrap_err().contains("min_new_tokens"));
        p.min_new_tokens = 0;
        p.frequency_penalty = 2.5;
        assert!(p.check().unwrap_err().contains("frequency_penalty"));
        p.frequency_penalty = 0.0;
        p.repetition_penalty = 0.0;
        assert!(p.check().unwrap_err().contains("repetition_penalty"));
        p.repetition_penalty = 1.2;
        assert!(p.check().is_ok() && p.penalized());
        p.logprobs = MAX_LOGPROBS + 1;
        assert!(p.check().unwrap_err().contains("logprobs"));
    }
}
