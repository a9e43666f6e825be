//! Per-request sampling parameters: the job's `sampling` section, with a row's values from the
//! input columns named by `sampling_columns` overriding it (a null falls back to the job's).
//!
//! One rule checks them (`SamplingParams::check`): the job's settings once, up front, and every
//! row's overrides as the row is read; a row whose values fail it becomes an error row naming
//! the column. The scheduler reads its stop conditions from here, the plan its per-row arrays.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{Float16Type, Float32Type, Float64Type};
use arrow_array::{Array, ArrayRef};
use arrow_schema::DataType;

use crate::column_kind::{dense, dense_type, int_value, is_int, is_list_of, is_text, str_value};
use crate::config::SchedulerConfig;

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
}

/// The most samples of one row; resume keys a row's samples `row_index * MAX_SAMPLES +
/// sample_index` (py/eaglebatch/resume.py `SAMPLE_STRIDE`), whatever each row's n.
pub const MAX_SAMPLES: usize = 4096;

/// The value kinds of the keys a column may set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Int,
    Float,
    Strings,
    Bool,
    /// A list of token ids.
    Ids,
}

/// Keys `sampling_columns` may map, with their kinds.
pub const COLUMN_KEYS: [&str; 16] = [
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
];

fn kind_of(key: &str) -> Option<Kind> {
    match key {
        "max_new_tokens" | "min_new_tokens" | "top_k" | "seed" | "logprobs" => Some(Kind::Int),
        "temperature" | "top_p" | "repetition_penalty" | "frequency_penalty"
        | "presence_penalty" | "min_p" => Some(Kind::Float),
        "stop" => Some(Kind::Strings),
        "ignore_eos" | "include_stop_str_in_output" | "skip_special_tokens" => Some(Kind::Bool),
        "stop_token_ids" => Some(Kind::Ids),
        _ => None,
    }
}

impl SamplingParams {
    /// The job's parameters (`sampling` section), unchecked.
    pub fn from_config(cfg: &SchedulerConfig) -> Self {
        SamplingParams {
            max_new_tokens: cfg.max_new_tokens,
            min_new_tokens: cfg.min_new_tokens,
            temperature: cfg.temperature,
            top_p: cfg.top_p,
            top_k: cfg.top_k,
            seed: None,
            repetition_penalty: cfg.repetition_penalty,
            frequency_penalty: cfg.frequency_penalty,
            presence_penalty: cfg.presence_penalty,
            stop: cfg.stop.iter().filter(|s| !s.is_empty()).cloned().collect(),
            logprobs: cfg.logprobs,
            min_p: cfg.min_p,
            ignore_eos: cfg.ignore_eos,
            stop_token_ids: cfg.stop_token_ids.clone(),
            include_stop_str_in_output: cfg.include_stop_str_in_output,
            skip_special_tokens: cfg.skip_special_tokens,
            vocab_size: cfg.vocab_size,
            n: cfg.n,
        }
    }

    /// Why the parameters are invalid (naming the key), if they are.
    pub fn check(&self) -> Result<(), String> {
        match self.violation() {
            Some((_, msg)) => Err(msg),
            None => Ok(()),
        }
    }

    /// The first rule the parameters break: the keys it involves and the message (naming
    /// them). Every float is finite, and a nonzero one a normal f32 (never subnormal).
    fn violation(&self) -> Option<(&'static [&'static str], String)> {
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
fn num(v: impl Into<f64>) -> String {
    let v: f64 = v.into();
    if v != 0.0 && v.is_finite() && !(1e-4..1e7).contains(&v.abs()) {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

/// Whether an input column of type `dt` can hold values of sampling key `key`; the error names
/// the key, the column and the expected type. The rule (inputs.py `_sampling_check` is the same
/// over pyarrow's types): integer keys take Int8..UInt64, float keys those and Float16..Float64,
/// `stop` a string or a list of strings, boolean keys Boolean, `stop_token_ids` a list of
/// integers; a dictionary-encoded column is judged by its values.
pub fn check_column_type(key: &str, column: &str, dt: &DataType) -> Result<(), String> {
    let Some(kind) = kind_of(key) else {
        return Err(format!(
            "sampling_columns: unknown key '{key}'; the keys are {}",
            COLUMN_KEYS.join(", ")
        ));
    };
    let values = dense_type(dt);
    let ok = match kind {
        Kind::Int => is_int(values),
        Kind::Float => is_int(values) || is_float(values),
        Kind::Strings => is_text(values) || is_list_of(values, is_text),
        Kind::Bool => values == &DataType::Boolean,
        Kind::Ids => is_list_of(values, is_int),
    };
    if ok {
        return Ok(());
    }
    let expected = match kind {
        Kind::Int => "an integer column",
        Kind::Float => "a numeric (integer or float) column",
        Kind::Strings => "a string or list<string> column",
        Kind::Bool => "a boolean column",
        Kind::Ids => "a list<integer> column",
    };
    Err(format!(
        "sampling_columns.{key}: column '{column}' has type {dt}; expected {expected}"
    ))
}

/// The float types `float_value` reads besides the integers (column_kind.rs `is_int`).
fn is_float(dt: &DataType) -> bool {
    matches!(
        dt,
        DataType::Float16 | DataType::Float32 | DataType::Float64
    )
}

/// One row's value of a column, as the key's kind reads it (None: null).
#[derive(Debug, Clone, PartialEq)]
enum Value {
    Int(i128),
    Float(f64),
    Strings(Vec<String>),
    Bool(bool),
    Ids(Vec<i128>),
}

/// Row `i` of a numeric column (`is_int` or `is_float`) as f64 (None when null).
fn float_value(a: &dyn Array, i: usize) -> Option<f64> {
    if a.is_null(i) {
        return None;
    }
    match a.data_type() {
        DataType::Float16 => Some(f64::from(a.as_primitive::<Float16Type>().value(i))),
        DataType::Float32 => Some(f64::from(a.as_primitive::<Float32Type>().value(i))),
        DataType::Float64 => Some(a.as_primitive::<Float64Type>().value(i)),
        _ => int_value(a, i).map(|v| v as f64),
    }
}

/// Row `i` of a string or list<string> column (a string is a list of one; null items are
/// dropped; None when the row is null).
fn strings_value(a: &dyn Array, i: usize) -> Option<Vec<String>> {
    if a.is_null(i) {
        return None;
    }
    let items = match a.data_type() {
        DataType::List(_) => a.as_list::<i32>().value(i),
        DataType::LargeList(_) => a.as_list::<i64>().value(i),
        _ => return str_value(a, i).map(|s| vec![s.to_string()]),
    };
    Some(
        (0..items.len())
            .filter_map(|j| str_value(items.as_ref(), j).map(str::to_string))
            .collect(),
    )
}

/// Row `i` of a list<integer> column (null items dropped; None when the row is null).
fn ids_value(a: &dyn Array, i: usize) -> Option<Vec<i128>> {
    if a.is_null(i) {
        return None;
    }
    let items = match a.data_type() {
        DataType::List(_) => a.as_list::<i32>().value(i),
        DataType::LargeList(_) => a.as_list::<i64>().value(i),
        _ => return None,
    };
    Some(
        (0..items.len())
            .filter_map(|j| dense(items.as_ref(), j).and_then(|(v, k)| int_value(v, k)))
            .collect(),
    )
}

fn read_value(key: &str, a: &dyn Array, i: usize) -> Option<Value> {
    let (a, i) = dense(a, i)?;
    match kind_of(key)? {
        Kind::Int => int_value(a, i).map(Value::Int),
        Kind::Float => float_value(a, i).map(Value::Float),
        Kind::Strings => strings_value(a, i).map(Value::Strings),
        Kind::Bool => (!a.is_null(i))
            .then(|| a.as_boolean().value(i))
            .map(Value::Bool),
        Kind::Ids => ids_value(a, i).map(Value::Ids),
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

/// Sets `key` to `v`; an integer out of the field's range, or a float f32 cannot hold, is an
/// error.
fn set(p: &mut SamplingParams, key: &str, v: Value) -> Result<(), String> {
    let range = |v: i128| format!("{v} is out of range");
    match (key, v) {
        ("max_new_tokens", Value::Int(v)) => {
            p.max_new_tokens = usize::try_from(v).map_err(|_| range(v))?
        }
        ("min_new_tokens", Value::Int(v)) => {
            p.min_new_tokens = usize::try_from(v).map_err(|_| range(v))?
        }
        ("top_k", Value::Int(v)) => p.top_k = i32::try_from(v).map_err(|_| range(v))?,
        ("seed", Value::Int(v)) => p.seed = row_seed(i64::try_from(v).map_err(|_| range(v))?),
        ("logprobs", Value::Int(v)) => p.logprobs = u32::try_from(v).map_err(|_| range(v))?,
        ("temperature", Value::Float(v)) if v > 0.0 && v < f64::from(SAMPLING_MIN) => {
            return Err(format!(
                "temperature must be 0 (greedy) or at least {SAMPLING_MIN:e}, got {}",
                num(v)
            ))
        }
        ("repetition_penalty", Value::Float(v)) if v < f64::from(SAMPLING_MIN) => {
            return Err(format!(
                "repetition_penalty must be at least {SAMPLING_MIN:e}, got {}",
                num(v)
            ))
        }
        ("temperature", Value::Float(v)) => p.temperature = to_f32(v)?,
        ("top_p", Value::Float(v)) => p.top_p = to_f32(v)?,
        ("repetition_penalty", Value::Float(v)) => p.repetition_penalty = to_f32(v)?,
        ("frequency_penalty", Value::Float(v)) => p.frequency_penalty = to_f32(v)?,
        ("presence_penalty", Value::Float(v)) => p.presence_penalty = to_f32(v)?,
        ("stop", Value::Strings(v)) => p.stop = v.into_iter().filter(|s| !s.is_empty()).collect(),
        ("min_p", Value::Float(v)) => p.min_p = to_f32(v)?,
        ("ignore_eos", Value::Bool(v)) => p.ignore_eos = v,
        ("include_stop_str_in_output", Value::Bool(v)) => p.include_stop_str_in_output = v,
        ("skip_special_tokens", Value::Bool(v)) => p.skip_special_tokens = v,
        ("stop_token_ids", Value::Ids(v)) => {
            p.stop_token_ids = v
                .into_iter()
                .map(|t| u32::try_from(t).map_err(|_| format!("token id {t} is out of range")))
                .collect::<Result<_, _>>()?
        }
        (key, v) => return Err(format!("internal: {key} cannot take {v:?}")),
    }
    Ok(())
}

/// The sampling columns of one record batch: (key, column name, array), in key order.
pub struct RowSampling {
    columns: Vec<(String, String, ArrayRef)>,
}

impl RowSampling {
    /// Looks up the mapped columns in a batch read with them projected (a missing one is left
    /// out; the schema check has already required them).
    pub fn new(map: &BTreeMap<String, String>, batch: &arrow_array::RecordBatch) -> Self {
        let columns = map
            .iter()
            .filter_map(|(k, c)| {
                batch
                    .column_by_name(c)
                    .map(|a| (k.clone(), c.clone(), a.clone()))
            })
            .collect();
        RowSampling { columns }
    }

    /// Row `i`'s parameters: `job`'s with every one of the row's non-null values set, then
    /// checked once by the job's rule (so values valid together pass whatever their order);
    /// the error names the row's columns (and keys) the broken rule involves.
    pub fn params(
        &self,
        job: &Arc<SamplingParams>,
        i: usize,
    ) -> Result<Arc<SamplingParams>, String> {
        let mut p: Option<SamplingParams> = None;
        let mut set_by: Vec<(&str, &str)> = Vec::new();
        for (key, column, a) in &self.columns {
            let Some(v) = read_value(key, a.as_ref(), i) else {
                continue;
            };
            let params = p.get_or_insert_with(|| job.as_ref().clone());
            set(params, key, v).map_err(|e| format!("sampling column '{column}' ({key}): {e}"))?;
            set_by.push((key, column));
        }
        let Some(p) = p else {
            return Ok(job.clone());
        };
        match p.violation() {
            None => Ok(Arc::new(p)),
            Some((keys, msg)) => Err(format!("{}: {msg}", columns_named(&set_by, keys))),
        }
    }
}

/// "sampling column 'c' (key)" for the row's columns whose keys a broken rule involves (all
/// the row's columns when none does: the rule then broke on the job's values alone).
fn columns_named(set_by: &[(&str, &str)], keys: &[&str]) -> String {
    let involved: Vec<&(&str, &str)> = set_by.iter().filter(|(k, _)| keys.contains(k)).collect();
    let named = if involved.is_empty() {
        set_by.iter().collect()
    } else {
        involved
    };
    let list: Vec<String> = named.iter().map(|(k, c)| format!("'{c}' ({k})")).collect();
    let s = if list.len() == 1 { "" } else { "s" };
    format!("sampling column{s} {}", list.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::builder::{ListBuilder, StringBuilder};
    use arrow_array::{Float64Array, Int64Array, RecordBatch, StringArray};
    use std::path::PathBuf;

    fn job() -> Arc<SamplingParams> {
        let cfg = SchedulerConfig::new(vec![], "p", PathBuf::new(), PathBuf::new());
        Arc::new(SamplingParams::from_config(&cfg))
    }

    fn batch(cols: Vec<(&str, ArrayRef)>) -> RecordBatch {
        RecordBatch::try_from_iter(cols).unwrap()
    }

    #[test]
    fn row_values_override_nulls_fall_back_and_bad_values_name_the_column() {
        let mut stops = ListBuilder::new(StringBuilder::new());
        stops.values().append_value("END");
        stops.append(true);
        stops.append(false);
        stops.append(true);
        let b = batch(vec![
            (
                "mt",
                Arc::new(Int64Array::from(vec![Some(7), None, Some(-1)])) as ArrayRef,
            ),
            (
                "t",
                Arc::new(Float64Array::from(vec![Some(0.5), None, Some(1.0)])),
            ),
            ("s", Arc::new(stops.finish())),
        ]);
        let map: BTreeMap<String, String> = [
            ("max_new_tokens", "mt"),
            ("temperature", "t"),
            ("stop", "s"),
        ]
        .into_iter()
        .map(|(k, c)| (k.to_string(), c.to_string()))
        .collect();
        let rows = RowSampling::new(&map, &b);
        let job = job();
        let r0 = rows.params(&job, 0).unwrap();
        assert_eq!((r0.max_new_tokens, r0.temperature), (7, 0.5));
        assert_eq!(r0.stop, vec!["END".to_string()]);
        let r1 = rows.params(&job, 1).unwrap();
        assert!(
            Arc::ptr_eq(&r1, &job),
            "all nulls: the job's own parameters"
        );
        let e = rows.params(&job, 2).unwrap_err();
        assert!(e.contains("'mt'") && e.contains("max_new_tokens"), "{e}");
    }

    #[test]
    fn a_negative_temperature_or_a_string_for_a_number_is_refused() {
        let b = batch(vec![(
            "t",
            Arc::new(Float64Array::from(vec![-0.5])) as ArrayRef,
        )]);
        let map = BTreeMap::from([("temperature".to_string(), "t".to_string())]);
        let e = RowSampling::new(&map, &b).params(&job(), 0).unwrap_err();
        assert!(e.contains("temperature must be"), "{e}");
        let e = check_column_type("temperature", "t", &DataType::Utf8).unwrap_err();
        assert!(e.contains("'t'") && e.contains("numeric"), "{e}");
        assert!(check_column_type("stop", "s", StringArray::from(vec!["x"]).data_type()).is_ok());
        assert!(check_column_type("top_k", "k", &DataType::Float64).is_err());
        assert!(check_column_type("bogus", "k", &DataType::Int64).is_err());
    }

    fn mapping(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, c)| (k.to_string(), c.to_string()))
            .collect()
    }

    /// Row 0's parameters with column `c` (of `arr`) mapped to `key`.
    fn one(key: &str, arr: ArrayRef) -> Result<Arc<SamplingParams>, String> {
        let b = batch(vec![("c", arr)]);
        RowSampling::new(&mapping(&[(key, "c")]), &b).params(&job(), 0)
    }

    #[test]
    fn tiny_subnormal_and_overflowing_floats_are_refused() {
        for (key, v) in [
            ("temperature", 1e-38),
            ("temperature", 1e-40),
            ("temperature", 5e-6),
            ("temperature", 1e39),
            ("repetition_penalty", 1e-45),
            ("repetition_penalty", 1e-6),
            ("top_p", 1e-300),
            ("frequency_penalty", 1e-300),
            ("presence_penalty", -1e-42),
        ] {
            let e = one(key, Arc::new(Float64Array::from(vec![v]))).unwrap_err();
            assert!(e.contains("'c'") && e.contains(key), "{key} {v}: {e}");
        }
        let e = one("temperature", Arc::new(Float64Array::from(vec![1e-6]))).unwrap_err();
        assert!(e.contains("1e-5") && e.contains("0 (greedy)"), "{e}");
        for (key, v) in [
            ("temperature", 1e-5),
            ("temperature", 0.0),
            ("repetition_penalty", 1e-5),
            ("repetition_penalty", 1e6),
            ("frequency_penalty", -0.0),
        ] {
            assert!(
                one(key, Arc::new(Float64Array::from(vec![v]))).is_ok(),
                "{key} {v}"
            );
        }
        // The job's own values follow the same rule.
        let mut p = job().as_ref().clone();
        p.temperature = 1e-6;
        assert!(p.check().unwrap_err().contains("temperature"));
        p.temperature = 1e-40;
        assert!(p.check().unwrap_err().contains("temperature"));
        p.temperature = 0.0;
        p.top_p = 1e-40;
        assert!(p.check().unwrap_err().contains("top_p"));
    }

    /// Every integer and float width reads as a number (max_new_tokens 3, temperature 0.5,
    /// row 1 null), dictionary-encoded columns through their keys.
    #[test]
    fn every_numeric_type_and_dictionaries_are_read() {
        use arrow_array::types::Int32Type as K;
        use arrow_array::*;
        type F16 = <Float16Type as arrow_array::ArrowPrimitiveType>::Native;
        let f16 = F16::from_f32;
        let ints: Vec<ArrayRef> = vec![
            Arc::new(Int8Array::from(vec![Some(3), None])),
            Arc::new(Int16Array::from(vec![Some(3), None])),
            Arc::new(Int32Array::from(vec![Some(3), None])),
            Arc::new(Int64Array::from(vec![Some(3), None])),
            Arc::new(UInt8Array::from(vec![Some(3), None])),
            Arc::new(UInt16Array::from(vec![Some(3), None])),
            Arc::new(UInt32Array::from(vec![Some(3), None])),
            Arc::new(UInt64Array::from(vec![Some(3), None])),
            Arc::new(DictionaryArray::<K>::new(
                Int32Array::from(vec![Some(0), None]),
                Arc::new(Int64Array::from(vec![3])),
            )),
        ];
        let floats: Vec<ArrayRef> = vec![
            Arc::new(Float16Array::from(vec![Some(f16(0.5)), None])),
            Arc::new(Float32Array::from(vec![Some(0.5), None])),
            Arc::new(Float64Array::from(vec![Some(0.5), None])),
            Arc::new(DictionaryArray::<arrow_array::types::Int8Type>::new(
                Int8Array::from(vec![Some(1), None]),
                Arc::new(Float64Array::from(vec![0.7, 0.5])),
            )),
        ];
        let job = job();
        for a in &ints {
            check_column_type("max_new_tokens", "c", a.data_type()).unwrap();
            check_column_type("temperature", "c", a.data_type()).unwrap();
            let b = batch(vec![("c", a.clone())]);
            let rows = RowSampling::new(&mapping(&[("max_new_tokens", "c")]), &b);
            assert_eq!(
                rows.params(&job, 0).unwrap().max_new_tokens,
                3,
                "{}",
                a.data_type()
            );
            assert!(Arc::ptr_eq(&rows.params(&job, 1).unwrap(), &job));
        }
        for a in &floats {
            check_column_type("temperature", "c", a.data_type()).unwrap();
            assert!(check_column_type("top_k", "c", a.data_type()).is_err());
            let b = batch(vec![("c", a.clone())]);
            let rows = RowSampling::new(&mapping(&[("temperature", "c")]), &b);
            assert_eq!(
                rows.params(&job, 0).unwrap().temperature,
                0.5,
                "{}",
                a.data_type()
            );
            assert!(Arc::ptr_eq(&rows.params(&job, 1).unwrap(), &job));
        }
        let stops: ArrayRef = Arc::new(DictionaryArray::<K>::new(
            Int32Array::from(vec![Some(0), None]),
            Arc::new(StringArray::from(vec!["END"])),
        ));
        check_column_type("stop", "s", stops.data_type()).unwrap();
        assert_eq!(one("stop", stops).unwrap().stop, vec!["END".to_string()]);
        for dt in [
            DataType::Boolean,
            DataType::Decimal128(10, 2),
            DataType::Utf8,
            DataType::Null,
            DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8)),
        ] {
            let e = check_column_type("temperature", "c", &dt).unwrap_err();
            assert!(e.contains("'c'") && e.contains("numeric"), "{e}");
        }
    }

    #[test]
    fn a_rows_overrides_are_checked_together() {
        let mut job = job().as_ref().clone();
        job.min_new_tokens = 2;
        let job = Arc::new(job);
        let b = batch(vec![
            ("mt", Arc::new(Int64Array::from(vec![1, 1])) as ArrayRef),
            ("mn", Arc::new(Int64Array::from(vec![Some(0), None]))),
        ]);
        let map = mapping(&[("max_new_tokens", "mt"), ("min_new_tokens", "mn")]);
        let rows = RowSampling::new(&map, &b);
        let p = rows.params(&job, 0).unwrap();
        assert_eq!((p.max_new_tokens, p.min_new_tokens), (1, 0));
        // Row 1 keeps the job's min_new_tokens 2 over its max_new_tokens 1: its column named.
        let e = rows.params(&job, 1).unwrap_err();
        assert!(
            e.starts_with("sampling column 'mt' (max_new_tokens): min_new_tokens (2)"),
            "{e}"
        );
        // Both columns break the rule together: both named.
        let b = batch(vec![
            ("mt", Arc::new(Int64Array::from(vec![1])) as ArrayRef),
            ("mn", Arc::new(Int64Array::from(vec![5]))),
        ]);
        let e = RowSampling::new(&map, &b).params(&job, 0).unwrap_err();
        assert!(
            e.contains("'mt' (max_new_tokens)") && e.contains("'mn' (min_new_tokens)"),
            "{e}"
        );
    }

    #[test]
    fn job_checks() {
        let mut p = job().as_ref().clone();
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

    /// The boolean and token-id keys: Boolean and list<integer> columns, read per row (a null
    /// falls back to the job's), other types refused by name; a row's seed -1 is no seed of its
    /// own, another negative one its seed.
    #[test]
    fn boolean_and_token_id_columns() {
        use arrow_array::builder::{Int32Builder, ListBuilder};
        use arrow_array::BooleanArray;
        let mut ids = ListBuilder::new(Int32Builder::new());
        ids.values().append_slice(&[5, 9]);
        ids.append(true);
        ids.append(false);
        let b = batch(vec![
            (
                "ie",
                Arc::new(BooleanArray::from(vec![Some(true), None])) as ArrayRef,
            ),
            ("st", Arc::new(ids.finish())),
            ("mp", Arc::new(Float64Array::from(vec![Some(0.1), None]))),
            ("sd", Arc::new(Int64Array::from(vec![-1, -7]))),
        ]);
        let map = mapping(&[
            ("ignore_eos", "ie"),
            ("stop_token_ids", "st"),
            ("min_p", "mp"),
            ("seed", "sd"),
        ]);
        let rows = RowSampling::new(&map, &b);
        let p = rows.params(&job(), 0).unwrap();
        assert!(p.ignore_eos && p.stop_token_ids == vec![5, 9] && p.min_p == 0.1);
        assert_eq!(p.seed, None);
        let p = rows.params(&job(), 1).unwrap();
        assert!(!p.ignore_eos && p.stop_token_ids.is_empty() && p.min_p == 0.0);
        assert_eq!(p.seed, Some(-7));
        let list_of =
            |t: DataType| DataType::List(Arc::new(arrow_schema::Field::new("item", t, true)));
        assert!(check_column_type("stop_token_ids", "c", &list_of(DataType::UInt16)).is_ok());
        let e = check_column_type("stop_token_ids", "c", &list_of(DataType::Utf8)).unwrap_err();
        assert!(e.contains("list<integer>"), "{e}");
        assert!(check_column_type("ignore_eos", "c", &DataType::Boolean).is_ok());
        let e = check_column_type("skip_special_tokens", "c", &DataType::Int8).unwrap_err();
        assert!(e.contains("a boolean column"), "{e}");
        assert!(check_column_type("min_p", "c", &DataType::Float32).is_ok());
        // out of range: a negative id, min_p above 1, an id past the vocabulary
        let mut neg = ListBuilder::new(Int32Builder::new());
        neg.values().append_value(-3);
        neg.append(true);
        let e = one("stop_token_ids", Arc::new(neg.finish())).unwrap_err();
        assert!(e.contains("'c'") && e.contains("-3"), "{e}");
        let e = one("min_p", Arc::new(Float64Array::from(vec![1.5]))).unwrap_err();
        assert!(e.contains("min_p must be in [0, 1]"), "{e}");
        let mut p = job().as_ref().clone();
        (p.vocab_size, p.stop_token_ids) = (10, vec![10]);
        assert!(p.check().unwrap_err().contains("stop_token_ids: 10"));
    }
}
