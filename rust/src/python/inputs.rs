//! The job side's door to the input and sampling rules, each stated once in Rust:
//! `check_inputs` (reader/validate.rs over the run's `RunConfig`) and `sampling_rule`
//! (sampling_params.rs `RANGES`). py/eaglebatch/job calls them before any model loads.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::scheduler_config::PyConfig;
use crate::exceptions::to_py;
use crate::reader::check_job_inputs;
use crate::sampling_params::{range_violation, to_f32};

/// Checks the job's input files as the reader will read them (`config`: a `SchedulerConfig`
/// whose `input_files` are resolved; `keep_all`: `output.keep_columns` is "*"); raises
/// UserInputError naming the key, column and file. Returns `total_rows` (capped by `limit`),
/// `kept` (the kept columns resolved), and for OpenAI Batch input `first_url` (the first
/// line's served url, or None) and `chat` (whether a line is a chat request).
#[pyfunction]
#[pyo3(signature = (config, keep_all = false))]
fn check_inputs<'py>(
    py: Python<'py>,
    config: PyConfig,
    keep_all: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let mut cfg = config.0;
    let spec = py
        .detach(|| check_job_inputs(&mut cfg, keep_all))
        .map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("total_rows", spec.total_rows)?;
    let kept: Vec<&String> = spec.kept.iter().map(|(name, _)| name).collect();
    d.set_item("kept", kept)?;
    d.set_item("first_url", spec.batch_lines.first.map(|e| e.url()))?;
    d.set_item("chat", spec.batch_lines.chat)?;
    Ok(d)
}

/// How `value` breaks the rule of sampling key `key` (its range; a float also as the f32 it
/// is held in), in words without the key; None when it keeps it (or `key` has no range).
#[pyfunction]
fn sampling_rule(key: &str, value: &Bound<'_, PyAny>) -> Option<String> {
    if let Ok(v) = value.extract::<i64>() {
        return range_violation(key, v as f64).map(str::to_string);
    }
    let v = value.extract::<f64>().unwrap_or(f64::NAN);
    if let Some(what) = range_violation(key, v) {
        return Some(what.to_string());
    }
    to_f32(v).err()
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(check_inputs, m)?)?;
    m.add_function(wrap_pyfunction!(sampling_rule, m)?)
}
