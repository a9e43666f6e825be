//! Per-request sampling parameters: the job's `sampling` section
//! (`SchedulerConfig::sampling_params`), with a row's values from the input columns named by
//! `sampling_columns` overriding it (a null falls back to the job's; reader/columns.rs reads
//! them) or an OpenAI Batch line's body (openai_batch.rs).
//!
//! One rule checks them (`SamplingParams::check`): the job's settings once, up front, and every
//! row's overrides as the row is read; a row whose values fail it becomes an error row naming
//! the column. The scheduler reads its stop conditions from here, the plan its per-row arrays.
//! A domain type: this module reads neither the config nor Arrow.

use std::sync::Arc;

use crate::structured::ResponseFormat;

/// The most top-logprob alternatives a request may ask for (vLLM's default limit).
pub const MAX_LOGPROBS: u32 = 20;

/// The smallest positive `temperature` and the smallest `repetition_penalty` (config.py's
/// SAMPLING_MIN is the same): logits divided by less overflow f32 and crash the sampler.
pub const SAMPLING_MIN: f32 = 1e-5;

/// The largest `temperature` and `repetition_penalty`.
pub const SAMPLING_MAX: f32 = 1e6;

#[derive(Debug, Clone, PartialEq)]
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
        if self.max_new_tokens == 0 || self.max_new_tokens > i32::MAX as usize {
            let msg = format!(
                "max_new_tokens must be in 1..={}, got {}",
                i32::MAX,
                self.max_new_tokens
            );
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
        let normal = |v: f32| v == 0.0 || v.is_normal();
        let in_range = |v: f32, lo: f32, hi: f32| normal(v) && v >= lo && v <= hi;
        let t = self.temperature;
        if !(t == 0.0 || in_range(t, SAMPLING_MIN, SAMPLING_MAX)) {
            let msg = format!(
                "temperature must be 0 (greedy) or a number in [{SAMPLING_MIN:e}, \
                 {SAMPLING_MAX:e}], got {}",
                num(t)
            );
            return Some((&["temperature"], msg));
        }
        if !(normal(self.top_p) && self.top_p > 0.0 && self.top_p <= 1.0) {
            return Some((
                &["top_p"],
                format!("top_p must be in (0, 1], got {}", num(self.top_p)),
            ));
        }
        let r = self.repetition_penalty;
        if !in_range(r, SAMPLING_MIN, SAMPLING_MAX) {
            let msg = format!(
                "repetition_penalty must be a number in [{SAMPLING_MIN:e}, {SAMPLING_MAX:e}] \
                 (1 = off), got {}",
                num(r)
            );
            return Some((&["repetition_penalty"], msg));
        }
        if !(normal(self.min_p) && (0.0..=1.0).contains(&self.min_p)) {
            let msg = format!("min_p must be in [0, 1] (0 = off), got {}", num(self.min_p));
            return Some((&["min_p"], msg));
        }
        for (name, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if !in_range(v, -2.0, 2.0) {
                let keys: &'static [&'static str] = if name == "frequency_penalty" {
                    &["frequency_penalty"]
                } else {
                    &["presence_penalty"]
                };
                return Some((
                    keys,
                    format!("{name} must be in [-2, 2] (0 = off), got {}", num(v)),
                ));
            }
        }
        None
    }

    fn integer_violation(&self) -> Option<(&'static [&'static str], String)> {
        if self.top_k < 0 {
            let msg = format!("top_k must be >= 0 (0 = off), got {}", self.top_k);
            return Some((&["top_k"], msg));
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
        if self.logprobs > MAX_LOGPROBS {
            let msg = format!(
                "logprobs must be in 0..={MAX_LOGPROBS}, got {}",
                self.logprobs
            );
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
    use crate::config::SchedulerConfig;
    use std::path::PathBuf;

    fn job() -> SamplingParams {
        SchedulerConfig::new(vec![], "p", PathBuf::new(), PathBuf::new()).sampling_params()
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
