//! Per-request sampling parameters: the job's `sampling` section, with a row's values from the
//! input columns named by `sampling_columns` overriding it (a null falls back to the job's).
//!
//! One rule checks them (`SamplingParams::check`): the job's settings once, up front, and every
//! row's overrides as the row is read; a row whose values fail it becomes an error row naming
//! the column. The scheduler reads its stop conditions from here, the plan its per-row arrays.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type,
    UInt64Type, UInt8Type,
};
use arrow_array::{Array, ArrayRef};
use arrow_schema::DataType;

use crate::config::SchedulerConfig;

/// The most top-logprob alternatives a request may ask for (vLLM's default limit).
pub const MAX_LOGPROBS: u32 = 20;

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
}

/// The value kinds of the keys a column may set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Int,
    Float,
    Strings,
}

/// Keys `sampling_columns` may map, with their kinds.
pub const COLUMN_KEYS: [&str; 11] = [
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
];

fn kind_of(key: &str) -> Option<Kind> {
    match key {
        "max_new_tokens" | "min_new_tokens" | "top_k" | "seed" | "logprobs" => Some(Kind::Int),
        "temperature" | "top_p" | "repetition_penalty" | "frequency_penalty"
        | "presence_penalty" => Some(Kind::Float),
        "stop" => Some(Kind::Strings),
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
        }
    }

    /// Why the parameters are invalid (naming the key), if they are.
    pub fn check(&self) -> Result<(), String> {
        let finite_in = |v: f32, lo: f32, hi: f32| v.is_finite() && v >= lo && v <= hi;
        if self.max_new_tokens == 0 || self.max_new_tokens > i32::MAX as usize {
            return Err(format!(
                "max_new_tokens must be in 1..={}, got {}",
                i32::MAX,
                self.max_new_tokens
            ));
        }
        if self.min_new_tokens > self.max_new_tokens {
            return Err(format!(
                "min_new_tokens ({}) must be <= max_new_tokens ({})",
                self.min_new_tokens, self.max_new_tokens
            ));
        }
        if !finite_in(self.temperature, 0.0, 1e6) {
            return Err(format!(
                "temperature must be a finite number in [0, 1e6], got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if self.top_k < 0 {
            return Err(format!("top_k must be >= 0 (0 = off), got {}", self.top_k));
        }
        if let Some(s) = self.seed.filter(|&s| s < 0) {
            return Err(format!("seed must be >= 0, got {s}"));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(format!(
                "repetition_penalty must be a finite number > 0 (1 = off), got {}",
                self.repetition_penalty
            ));
        }
        for (name, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if !finite_in(v, -2.0, 2.0) {
                return Err(format!("{name} must be in [-2, 2] (0 = off), got {v}"));
            }
        }
        if self.logprobs > MAX_LOGPROBS {
            return Err(format!(
                "logprobs must be in 0..={MAX_LOGPROBS}, got {}",
                self.logprobs
            ));
        }
        Ok(())
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

/// Whether an input column of type `dt` can hold values of sampling key `key`; the error names
/// the key, the column and the expected type.
pub fn check_column_type(key: &str, column: &str, dt: &DataType) -> Result<(), String> {
    let Some(kind) = kind_of(key) else {
        return Err(format!(
            "sampling_columns: unknown key '{key}'; the keys are {}",
            COLUMN_KEYS.join(", ")
        ));
    };
    let ok = match kind {
        Kind::Int => dt.is_integer(),
        Kind::Float => dt.is_integer() || dt.is_floating(),
        Kind::Strings => {
            is_text(dt)
                || matches!(dt, DataType::List(f) | DataType::LargeList(f) if is_text(f.data_type()))
        }
    };
    if ok {
        return Ok(());
    }
    let expected = match kind {
        Kind::Int => "an integer column",
        Kind::Float => "a numeric column",
        Kind::Strings => "a string or list<string> column",
    };
    Err(format!(
        "sampling_columns.{key}: column '{column}' has type {dt}; expected {expected}"
    ))
}

fn is_text(dt: &DataType) -> bool {
    matches!(
        dt,
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
    )
}

/// One row's value of a column, as the key's kind reads it (None: null).
#[derive(Debug, Clone, PartialEq)]
enum Value {
    Int(i128),
    Float(f64),
    Strings(Vec<String>),
}

/// Row `i` of an integer column, widened (None when null or not an integer type).
fn int_value(a: &dyn Array, i: usize) -> Option<i128> {
    if a.is_null(i) {
        return None;
    }
    macro_rules! get {
        ($t:ty) => {
            Some(a.as_primitive::<$t>().value(i) as i128)
        };
    }
    match a.data_type() {
        DataType::Int8 => get!(Int8Type),
        DataType::Int16 => get!(Int16Type),
        DataType::Int32 => get!(Int32Type),
        DataType::Int64 => get!(Int64Type),
        DataType::UInt8 => get!(UInt8Type),
        DataType::UInt16 => get!(UInt16Type),
        DataType::UInt32 => get!(UInt32Type),
        DataType::UInt64 => get!(UInt64Type),
        _ => None,
    }
}

/// Row `i` of a numeric column as f64 (None when null).
fn float_value(a: &dyn Array, i: usize) -> Option<f64> {
    if a.is_null(i) {
        return None;
    }
    match a.data_type() {
        DataType::Float32 => Some(a.as_primitive::<Float32Type>().value(i) as f64),
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
        _ => return crate::reader::str_value(a, i).map(|s| vec![s.to_string()]),
    };
    Some(
        (0..items.len())
            .filter_map(|j| crate::reader::str_value(items.as_ref(), j).map(str::to_string))
            .collect(),
    )
}

fn read_value(key: &str, a: &dyn Array, i: usize) -> Option<Value> {
    match kind_of(key)? {
        Kind::Int => int_value(a, i).map(Value::Int),
        Kind::Float => float_value(a, i).map(Value::Float),
        Kind::Strings => strings_value(a, i).map(Value::Strings),
    }
}

/// Sets `key` to `v`; an integer out of the field's range is an error.
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
        ("seed", Value::Int(v)) => p.seed = Some(i64::try_from(v).map_err(|_| range(v))?),
        ("logprobs", Value::Int(v)) => p.logprobs = u32::try_from(v).map_err(|_| range(v))?,
        ("temperature", Value::Float(v)) => p.temperature = v as f32,
        ("top_p", Value::Float(v)) => p.top_p = v as f32,
        ("repetition_penalty", Value::Float(v)) => p.repetition_penalty = v as f32,
        ("frequency_penalty", Value::Float(v)) => p.frequency_penalty = v as f32,
        ("presence_penalty", Value::Float(v)) => p.presence_penalty = v as f32,
        ("stop", Value::Strings(v)) => p.stop = v.into_iter().filter(|s| !s.is_empty()).collect(),
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

    /// Row `i`'s parameters: `job`'s with the row's non-null values; the error names the
    /// column and key when a value is invalid.
    pub fn params(
        &self,
        job: &Arc<SamplingParams>,
        i: usize,
    ) -> Result<Arc<SamplingParams>, String> {
        let mut p: Option<SamplingParams> = None;
        for (key, column, a) in &self.columns {
            let Some(v) = read_value(key, a.as_ref(), i) else {
                continue;
            };
            let params = p.get_or_insert_with(|| job.as_ref().clone());
            set(params, key, v)
                .and_then(|_| params.check())
                .map_err(|e| format!("sampling column '{column}' ({key}): {e}"))?;
        }
        Ok(p.map(Arc::new).unwrap_or_else(|| job.clone()))
    }
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
}
