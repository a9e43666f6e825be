//! Per-row sampling overrides read out of Arrow columns: which column types a sampling key
//! takes (`check_column_type`, at validation) and each row's values (`RowSampling`, as batches
//! are read), applied over the job's `SamplingParams` and checked by its rule.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{Float16Type, Float32Type, Float64Type};
use arrow_array::{Array, ArrayRef};
use arrow_schema::DataType;

use crate::column_kind::{dense, dense_type, int_value, is_int, is_list_of, is_text, str_value};
use crate::sampling_params::{held_f32, row_seed, SamplingParams, COLUMN_KEYS};
use crate::structured::ResponseFormat;

/// The value kinds of the keys a column may set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Int,
    Float,
    Strings,
    Bool,
    /// A list of token ids.
    Ids,
    /// A JSON text (`response_format`).
    Json,
}

fn kind_of(key: &str) -> Option<Kind> {
    match key {
        "max_new_tokens" | "min_new_tokens" | "top_k" | "seed" | "logprobs" => Some(Kind::Int),
        "temperature" | "top_p" | "repetition_penalty" | "frequency_penalty"
        | "presence_penalty" | "min_p" => Some(Kind::Float),
        "stop" => Some(Kind::Strings),
        "ignore_eos" | "include_stop_str_in_output" | "skip_special_tokens" => Some(Kind::Bool),
        "stop_token_ids" => Some(Kind::Ids),
        "response_format" => Some(Kind::Json),
        _ => None,
    }
}

/// Every key of `input.sampling_columns` is one a column may set (`COLUMN_KEYS`); the error
/// names the first unknown one and lists the keys.
pub fn check_column_keys<'a>(keys: impl IntoIterator<Item = &'a String>) -> Result<(), String> {
    match keys.into_iter().find(|k| kind_of(k).is_none()) {
        None => Ok(()),
        Some(k) => Err(format!(
            "input.sampling_columns: unknown key '{k}'; the keys are {}",
            COLUMN_KEYS.join(", ")
        )),
    }
}

/// Whether an input column of type `dt` can hold values of sampling key `key`; the error is
/// the type expected, in words. The rule: integer keys take Int8..UInt64, float keys those and
/// Float16..Float64, `stop` a string or a list of strings, boolean keys Boolean,
/// `stop_token_ids` a list of integers, `response_format` a string; a dictionary-encoded
/// column is judged by its values. (An unknown key: `check_column_keys`.)
pub fn check_column_type(key: &str, dt: &DataType) -> Result<(), &'static str> {
    let Some(kind) = kind_of(key) else {
        return Err("no column (unknown sampling key)");
    };
    let values = dense_type(dt);
    let ok = match kind {
        Kind::Int => is_int(values),
        Kind::Float => is_int(values) || is_float(values),
        Kind::Strings => is_text(values) || is_list_of(values, is_text),
        Kind::Bool => values == &DataType::Boolean,
        Kind::Ids => is_list_of(values, is_int),
        Kind::Json => is_text(values),
    };
    if ok {
        return Ok(());
    }
    Err(match kind {
        Kind::Int => "an integer",
        Kind::Float => "a number (integer or float)",
        Kind::Strings => "a string or list<string>",
        Kind::Bool => "a boolean",
        Kind::Ids => "a list of integers",
        Kind::Json => "a string (a response_format's JSON text)",
    })
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
    Json(String),
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
        Kind::Json => str_value(a, i).map(|s| Value::Json(s.to_string())),
    }
}

/// The field a float key sets.
fn float_field<'a>(p: &'a mut SamplingParams, key: &str) -> Option<&'a mut f32> {
    Some(match key {
        "temperature" => &mut p.temperature,
        "top_p" => &mut p.top_p,
        "repetition_penalty" => &mut p.repetition_penalty,
        "frequency_penalty" => &mut p.frequency_penalty,
        "presence_penalty" => &mut p.presence_penalty,
        "min_p" => &mut p.min_p,
        _ => return None,
    })
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
        (key, Value::Float(v)) if kind_of(key) == Some(Kind::Float) => {
            *float_field(p, key).ok_or_else(|| format!("internal: {key} is no float"))? =
                held_f32(key, v)?
        }
        ("stop", Value::Strings(v)) => p.stop = v.into_iter().filter(|s| !s.is_empty()).collect(),
        ("ignore_eos", Value::Bool(v)) => p.ignore_eos = v,
        ("include_stop_str_in_output", Value::Bool(v)) => p.include_stop_str_in_output = v,
        ("skip_special_tokens", Value::Bool(v)) => p.skip_special_tokens = v,
        ("stop_token_ids", Value::Ids(v)) => {
            p.stop_token_ids = v
                .into_iter()
                .map(|t| u32::try_from(t).map_err(|_| format!("token id {t} is out of range")))
                .collect::<Result<_, _>>()?
        }
        ("response_format", Value::Json(text)) => {
            p.response_format = ResponseFormat::parse_request(&text)?.map(Arc::new)
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
    use crate::config::RunConfig;
    use arrow_array::builder::{ListBuilder, StringBuilder};
    use arrow_array::{Float64Array, Int64Array, RecordBatch, StringArray};
    use std::path::PathBuf;

    fn job() -> Arc<SamplingParams> {
        let cfg = RunConfig::new(vec![], "p", PathBuf::new(), PathBuf::new());
        Arc::new(cfg.sampling_params())
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
        let e = check_column_type("temperature", &DataType::Utf8).unwrap_err();
        assert_eq!(e, "a number (integer or float)");
        assert!(check_column_type("stop", StringArray::from(vec!["x"]).data_type()).is_ok());
        assert!(check_column_type("top_k", &DataType::Float64).is_err());
        assert!(check_column_type("bogus", &DataType::Int64).is_err());
        let keys = ["top_k".to_string(), "temprature".to_string()];
        let e = check_column_keys(&keys).unwrap_err();
        assert!(
            e.starts_with("input.sampling_columns: unknown key 'temprature'"),
            "{e}"
        );
        assert!(check_column_keys(&keys[..1]).is_ok());
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
            check_column_type("max_new_tokens", a.data_type()).unwrap();
            check_column_type("temperature", a.data_type()).unwrap();
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
            check_column_type("temperature", a.data_type()).unwrap();
            assert!(check_column_type("top_k", a.data_type()).is_err());
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
        check_column_type("stop", stops.data_type()).unwrap();
        assert_eq!(one("stop", stops).unwrap().stop, vec!["END".to_string()]);
        for dt in [
            DataType::Boolean,
            DataType::Decimal128(10, 2),
            DataType::Utf8,
            DataType::Null,
            DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8)),
        ] {
            let e = check_column_type("temperature", &dt).unwrap_err();
            assert_eq!(e, "a number (integer or float)");
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
        assert!(check_column_type("stop_token_ids", &list_of(DataType::UInt16)).is_ok());
        let e = check_column_type("stop_token_ids", &list_of(DataType::Utf8)).unwrap_err();
        assert_eq!(e, "a list of integers");
        assert!(check_column_type("ignore_eos", &DataType::Boolean).is_ok());
        let e = check_column_type("skip_special_tokens", &DataType::Int8).unwrap_err();
        assert_eq!(e, "a boolean");
        assert!(check_column_type("min_p", &DataType::Float32).is_ok());
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
