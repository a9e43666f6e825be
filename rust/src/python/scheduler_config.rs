//! `RunConfig` from its Python twin (`eaglebatch.job.scheduler_config.SchedulerConfig`, or any
//! object with its attributes): `task` and each section (`input`, `output`, `storage`,
//! `policy`, `sampling`) by attribute, each section's fields by attribute of their name, read
//! here at the boundary so that config.rs knows nothing of Python.

use std::sync::Arc;

use numpy::PyReadonlyArray1;
use pyo3::conversion::FromPyObjectOwned;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::config::{InputConfig, OutputConfig, PolicyConfig, RunConfig, SamplingConfig};
use crate::sampling_params::SamplingParams;
use crate::storage::StorageSettings;

/// The `config` argument of `Scheduler(config)`.
pub(super) struct PyConfig(pub(super) RunConfig);

/// The field list, declared once: `FIELDS` (every setting's dotted name, `section.field`,
/// exported to Python as `SCHEDULER_CONFIG_FIELDS`, where a test holds the dataclasses'
/// fields equal to it) and `read`, `RunConfig { task: ..., input: InputConfig { field:
/// attribute(section, "field", extract)?, ... }, ... }` (`field with f` converts by `f`). The
/// sampling section's `params` is the one `SamplingParams` value every row starts from: its
/// fields are read from the same Python section, but for `fixed` ones (a row's own seed, the
/// parsed response_format, set by `read`). A struct literal names every field, so a setting
/// added to a struct does not compile until it is listed here too.
macro_rules! config_fields {
    (
        top: $($top:ident),* ;
        sampling: { $($sfield:ident $(with $sconvert:expr)?),* $(,)? }
        params: { $($pfield:ident $(with $pconvert:expr)?),* $(,)? }
        fixed: { $($xfield:ident: $xvalue:expr),* $(,)? }
        $($section:ident: $ty:ident { $($field:ident $(with $convert:expr)?),* $(,)? })*
    ) => {
        pub(crate) const FIELDS: &[&str] = &[
            $(stringify!($top),)*
            $($(concat!(stringify!($section), ".", stringify!($field)),)*)*
            $(concat!("sampling.", stringify!($sfield)),)*
            $(concat!("sampling.", stringify!($pfield)),)*
        ];

        /// The fields in declaration order (the first one that fails raises).
        fn read<'py>(obj: &Bound<'py, PyAny>) -> PyResult<RunConfig> {
            Ok(RunConfig {
                $($top: attribute(obj, "", stringify!($top), extract)?,)*
                $($section: {
                    let s = obj.getattr(stringify!($section))?;
                    let name = concat!(stringify!($section), ".");
                    $ty {
                        $($field: attribute(&s, name, stringify!($field),
                                            config_fields!(@ $($convert)?))?,)*
                    }
                },)*
                sampling: {
                    let s = obj.getattr("sampling")?;
                    SamplingConfig {
                        $($sfield: attribute(&s, "sampling.", stringify!($sfield),
                                             config_fields!(@ $($sconvert)?))?,)*
                        params: SamplingParams {
                            $($pfield: attribute(&s, "sampling.", stringify!($pfield),
                                                 config_fields!(@ $($pconvert)?))?,)*
                            $($xfield: $xvalue,)*
                        },
                    }
                },
            })
        }
    };
    (@) => { extract };
    (@ $convert:expr) => { $convert };
}

config_fields! {
    top: task;
    sampling: { seed, response_format with json_text, eos_token_ids }
    params: {
        max_new_tokens, min_new_tokens, temperature, top_p, top_k, repetition_penalty,
        frequency_penalty, presence_penalty, stop with stop_strings, logprobs, min_p,
        ignore_eos, stop_token_ids, include_stop_str_in_output, skip_special_tokens,
        vocab_size, n,
    }
    fixed: { seed: None, response_format: None }
    input: InputConfig {
        input_files, prompt_column, messages_column, id_column, input_format, limit, row_range,
        skip_rows with int64_array, skip_samples with int64_array, continuation_column,
        choices_column, prompt_prefix, truncate, sampling_columns, add_special_tokens, apply_chat_template,
        tokenizer_file, chat_template, bos_token, eos_token, enable_thinking, read_batch_rows,
        queue_rows,
    }
    output: OutputConfig {
        output_dir, part_rows, file_metadata, include_token_ids, keep_columns, flush_interval_s,
        prompt_logprobs, reasoning_ids, pooling, pool_width, pool_normalize, pool_dimensions,
        labels, multi_label,
    }
    storage: StorageSettings { endpoint, options, unconditional }
    policy: PolicyConfig {
        num_blocks, block_size, max_batch_size, max_num_batched_tokens, max_model_len,
        max_draft_tokens, prefix_caching, chunked_prefill, overlap, state_checkpoint_interval,
        state_checkpoints,
    }
}

/// The config with its sampling defaults' response_format parsed from the job's text (None
/// when it does not parse: `RunConfig::validate` reports that, prefixed by its key).
fn read_config(obj: &Bound<'_, PyAny>) -> PyResult<RunConfig> {
    let mut cfg = read(obj)?;
    cfg.sampling.params.response_format = cfg.job_response_format().ok().flatten().map(Arc::new);
    Ok(cfg)
}

impl<'a, 'py> FromPyObject<'a, 'py> for PyConfig {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        read_config(&obj).map(PyConfig)
    }
}

/// Attribute `name` of `obj` (the config, or its section `section`, "input." say) converted
/// by `convert`; a value that does not convert raises TypeError "failed to extract field
/// SchedulerConfig.<section><name>" caused by the conversion's error (pyo3's message for a
/// derived extraction).
fn attribute<'py, T>(
    obj: &Bound<'py, PyAny>,
    section: &str,
    name: &str,
    convert: fn(&Bound<'py, PyAny>) -> PyResult<T>,
) -> PyResult<T> {
    let value = obj.getattr(name)?;
    convert(&value).map_err(|cause| {
        let err = PyTypeError::new_err(format!(
            "failed to extract field SchedulerConfig.{section}{name}"
        ));
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

/// `stop`: the job's stop strings but empty ones (which would stop every row at once).
fn stop_strings(obj: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
    let stop: Vec<String> = obj.extract()?;
    Ok(stop.into_iter().filter(|s| !s.is_empty()).collect())
}
