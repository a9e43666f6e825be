//! `SchedulerConfig` from its Python twin (`eaglebatch.job.scheduler_config.SchedulerConfig`,
//! or any object with its attributes): each field from the attribute of its name, read here at
//! the boundary so that config.rs knows nothing of Python.

use numpy::PyReadonlyArray1;
use pyo3::conversion::FromPyObjectOwned;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::config::{PolicyConfig, SchedulerConfig};

/// The `config` argument of `Scheduler(config)`.
pub(super) struct PyConfig(pub(super) SchedulerConfig);

/// The field list, declared once: `FIELDS` (every field's name, the policy section's flattened
/// into it, exported to Python as `SCHEDULER_CONFIG_FIELDS`, where a test holds the
/// dataclass's fields equal to it) and `read`, `SchedulerConfig { field: attribute(obj,
/// "field", extract)?, ..., policy: PolicyConfig { ... } }` (`field with f` converts by `f`).
/// A struct literal names every field, so a setting added to the struct does not compile until
/// it is listed here too.
macro_rules! config_fields {
    ($($field:ident $(with $convert:expr)?),* ; policy: $($policy:ident),* $(,)?) => {
        pub(crate) const FIELDS: &[&str] =
            &[$(stringify!($field),)* $(stringify!($policy)),*];

        /// The fields in declaration order, the policy's last (the first one that fails
        /// raises).
        fn read<'py>(obj: &Bound<'py, PyAny>) -> PyResult<SchedulerConfig> {
            Ok(SchedulerConfig {
                $($field: attribute(obj, stringify!($field), config_fields!(@ $($convert)?))?,)*
                policy: PolicyConfig {
                    $($policy: attribute(obj, stringify!($policy), extract)?),*
                },
            })
        }
    };
    (@) => { extract };
    (@ $convert:expr) => { $convert };
}

config_fields! {
    input_files, prompt_column, messages_column, id_column, input_format, limit,
    row_range, skip_rows with int64_array, skip_samples with int64_array,
    task, continuation_column, choices_column, add_special_tokens, apply_chat_template, tokenizer_file, chat_template, bos_token, eos_token,
    eos_token_ids, vocab_size, storage_endpoint, storage_options,
    storage_unconditional,
    output_dir, part_rows, file_metadata, include_token_ids, keep_columns,
    flush_interval_s,
    max_new_tokens, stop, temperature, top_p, top_k, seed, min_new_tokens, min_p,
    ignore_eos, stop_token_ids, include_stop_str_in_output, skip_special_tokens,
    repetition_penalty, frequency_penalty, presence_penalty, logprobs, prompt_logprobs,
    response_format with json_text, enable_thinking, reasoning_ids, sampling_columns, n,
    read_batch_rows, queue_rows;
    policy: num_blocks, block_size, max_batch_size, max_num_batched_tokens, max_model_len,
    max_draft_tokens, prefix_caching, chunked_prefill, overlap,
}

impl<'a, 'py> FromPyObject<'a, 'py> for PyConfig {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        read(&obj).map(PyConfig)
    }
}

/// Attribute `name` of `obj` converted by `convert`; a value that does not convert raises
/// TypeError "failed to extract field SchedulerConfig.<name>" caused by the conversion's error
/// (pyo3's message for a derived extraction).
fn attribute<'py, T>(
    obj: &Bound<'py, PyAny>,
    name: &str,
    convert: fn(&Bound<'py, PyAny>) -> PyResult<T>,
) -> PyResult<T> {
    let value = obj.getattr(name)?;
    convert(&value).map_err(|cause| {
        let err = PyTypeError::new_err(format!("failed to extract field SchedulerConfig.{name}"));
        err.set_cause(obj.py(), Some(cause));
        err
    })
}

fn extract<'py, T: FromPyObjectOwned<'py>>(value: &Bound<'py, PyAny>) -> PyResult<T> {
    value.extract().map_err(Into::into)
}

/// `response_format`: a mapping (or None: "") as the JSON text `json.dumps` makes of it (key
/// order kept: a schema's properties are generated in their order); a str is that text.
pub(super) fn json_text(obj: &Bound<'_, PyAny>) -> PyResult<String> {
    if obj.is_none() {
        return Ok(String::new());
    }
    if let Ok(s) = obj.extract::<String>() {
        return Ok(s);
    }
    let json = obj.py().import("json")?;
    json.call_method1("dumps", (obj,))?.extract()
}

/// `skip_rows` and `skip_samples`: an int64 (or int32) numpy array, a sequence of ints, or None.
fn int64_array(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    if obj.is_none() {
        return Ok(Vec::new());
    }
    int64_vec(obj, "skip_rows")
}

/// A 1-D int64 array (numpy int64 preferred; other integer numpy arrays and Python sequences
/// of ints are accepted).
fn int64_vec(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<i64>> {
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        return Ok(a.as_array().to_vec());
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        return Ok(a.as_array().iter().map(|&v| v as i64).collect());
    }
    obj.extract::<Vec<i64>>()
        .map_err(|_| PyTypeError::new_err(format!("{name} must be a 1-D int64 numpy array")))
}
