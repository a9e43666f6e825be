//! PyO3 bindings: module `eaglebatch._native` (contract: `py/eaglebatch/_native.pyi`), the
//! scheduler's half (`Scheduler`, `StepPlan`, the chat template functions); the module init
//! also registers the CPU kernels' half (`cpu::bindings`).
//!
//! Thin by design: argument conversion (`scheduler_config` reads the `RunConfig`), GIL release
//! around every call into the core, numpy arrays out; errors become Python exceptions in
//! `exceptions`.

use numpy::{
    IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};

use crate::chat_template::{self, Message};
use crate::exceptions::{to_py, NativeError, UserInputError};
use crate::logprobs::{PromptLogprobs, StepLogprobs};
use crate::run::{PooledSums, Run};
use crate::scheduler::StepPlan;
use crate::stats::SummaryValue;

mod inputs;
mod object_store;
mod scheduler_config;

/// One forward step (see the .pyi for every field).
#[pyclass(module = "eaglebatch._native", name = "StepPlan", frozen)]
pub struct PyStepPlan {
    #[pyo3(get)]
    kind: &'static str,
    #[pyo3(get)]
    num_seqs: usize,
    #[pyo3(get)]
    num_tokens: usize,
    #[pyo3(get)]
    request_slots: Py<PyArray1<i32>>,
    #[pyo3(get)]
    input_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    positions: Py<PyArray1<i64>>,
    #[pyo3(get)]
    cu_seqlens_q: Py<PyArray1<i32>>,
    #[pyo3(get)]
    seq_lens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    block_tables: Py<PyArray2<i32>>,
    #[pyo3(get)]
    slot_mapping: Py<PyArray1<i64>>,
    #[pyo3(get)]
    temperature: Py<PyArray1<f32>>,
    #[pyo3(get)]
    top_p: Py<PyArray1<f32>>,
    #[pyo3(get)]
    top_k: Py<PyArray1<i32>>,
    #[pyo3(get)]
    seeds: Py<PyArray1<i64>>,
    #[pyo3(get)]
    num_generated: Py<PyArray1<i32>>,
    #[pyo3(get)]
    min_tokens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    end_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    cu_end_ids: Py<PyArray1<i32>>,
    #[pyo3(get)]
    min_p: Py<PyArray1<f32>>,
    #[pyo3(get)]
    repetition_penalty: Py<PyArray1<f32>>,
    #[pyo3(get)]
    frequency_penalty: Py<PyArray1<f32>>,
    #[pyo3(get)]
    presence_penalty: Py<PyArray1<f32>>,
    #[pyo3(get)]
    logprobs: Py<PyArray1<i32>>,
    #[pyo3(get)]
    prompt_logprobs: Py<PyArray1<i32>>,
    #[pyo3(get)]
    prompt_lens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    prompt_logprobs_from: Py<PyArray1<i32>>,
    #[pyo3(get)]
    penalty_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    cu_penalty: Py<PyArray1<i32>>,
    #[pyo3(get)]
    penalty_prompt_lens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    prefix_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    cu_prefix: Py<PyArray1<i32>>,
    #[pyo3(get)]
    block_copies: Py<PyArray2<i32>>,
    #[pyo3(get)]
    next_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    prev_rows: Py<PyArray1<i32>>,
    #[pyo3(get)]
    mask_rows: Py<PyArray1<i32>>,
    #[pyo3(get)]
    token_masks: Py<PyArray2<u32>>,
    #[pyo3(get)]
    forced_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    cu_forced: Py<PyArray1<i32>>,
    #[pyo3(get)]
    state_from: Py<PyArray1<i32>>,
    #[pyo3(get)]
    state_saves: Py<PyArray2<i32>>,
    #[pyo3(get)]
    max_seqlen_q: usize,
    #[pyo3(get)]
    max_seqlen_k: usize,
}

#[pymethods]
impl PyStepPlan {
    fn __repr__(&self) -> String {
        format!(
            "StepPlan(kind={:?}, num_seqs={}, num_tokens={}, max_seqlen_q={}, max_seqlen_k={})",
            self.kind, self.num_seqs, self.num_tokens, self.max_seqlen_q, self.max_seqlen_k
        )
    }
}

impl PyStepPlan {
    fn new(py: Python<'_>, p: StepPlan) -> PyResult<Self> {
        let b = p.num_seqs();
        let num_tokens = p.num_tokens();
        let block_tables = p
            .block_tables
            .into_pyarray(py)
            .reshape([b, p.block_table_width])?;
        let num_copies = p.block_copies.len() / 2;
        let copies = p.block_copies.into_pyarray(py).reshape([num_copies, 2])?;
        let words = p.mask_words.max(1);
        let num_masks = p.token_masks.len() / words;
        let masks = p.token_masks.into_pyarray(py).reshape([num_masks, words])?;
        let num_saves = p.state_saves.len() / 3;
        let saves = p.state_saves.into_pyarray(py).reshape([num_saves, 3])?;
        Ok(PyStepPlan {
            kind: p.kind.as_str(),
            num_seqs: b,
            num_tokens,
            request_slots: p.request_slots.into_pyarray(py).unbind(),
            input_ids: p.input_ids.into_pyarray(py).unbind(),
            positions: p.positions.into_pyarray(py).unbind(),
            cu_seqlens_q: p.cu_seqlens_q.into_pyarray(py).unbind(),
            seq_lens: p.seq_lens.into_pyarray(py).unbind(),
            block_tables: block_tables.unbind(),
            slot_mapping: p.slot_mapping.into_pyarray(py).unbind(),
            temperature: p.temperature.into_pyarray(py).unbind(),
            top_p: p.top_p.into_pyarray(py).unbind(),
            top_k: p.top_k.into_pyarray(py).unbind(),
            seeds: p.seeds.into_pyarray(py).unbind(),
            num_generated: p.num_generated.into_pyarray(py).unbind(),
            min_tokens: p.min_tokens.into_pyarray(py).unbind(),
            end_ids: p.end_ids.into_pyarray(py).unbind(),
            cu_end_ids: p.cu_end_ids.into_pyarray(py).unbind(),
            min_p: p.min_p.into_pyarray(py).unbind(),
            repetition_penalty: p.repetition_penalty.into_pyarray(py).unbind(),
            frequency_penalty: p.frequency_penalty.into_pyarray(py).unbind(),
            presence_penalty: p.presence_penalty.into_pyarray(py).unbind(),
            logprobs: p.logprobs.into_pyarray(py).unbind(),
            prompt_logprobs: p.prompt_logprobs.into_pyarray(py).unbind(),
            prompt_lens: p.prompt_lens.into_pyarray(py).unbind(),
            prompt_logprobs_from: p.prompt_logprobs_from.into_pyarray(py).unbind(),
            penalty_ids: p.penalty_ids.into_pyarray(py).unbind(),
            cu_penalty: p.cu_penalty.into_pyarray(py).unbind(),
            penalty_prompt_lens: p.penalty_prompt_lens.into_pyarray(py).unbind(),
            prefix_ids: p.prefix_ids.into_pyarray(py).unbind(),
            cu_prefix: p.cu_prefix.into_pyarray(py).unbind(),
            block_copies: copies.unbind(),
            next_ids: p.next_ids.into_pyarray(py).unbind(),
            prev_rows: p.prev_rows.into_pyarray(py).unbind(),
            mask_rows: p.mask_rows.into_pyarray(py).unbind(),
            token_masks: masks.unbind(),
            forced_ids: p.forced_ids.into_pyarray(py).unbind(),
            cu_forced: p.cu_forced.into_pyarray(py).unbind(),
            state_from: p.state_from.into_pyarray(py).unbind(),
            state_saves: saves.unbind(),
            max_seqlen_q: p.max_seqlen_q,
            max_seqlen_k: p.max_seqlen_k,
        })
    }
}

/// A 1-D integer array (numpy int32 preferred; int64 numpy arrays and Python sequences of ints
/// are accepted and range-checked).
fn int32_vec(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<i32>> {
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        return Ok(a.as_array().iter().copied().collect());
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        return a
            .as_array()
            .iter()
            .map(|&v| {
                i32::try_from(v)
                    .map_err(|_| PyValueError::new_err(format!("{name}: value {v} out of int32")))
            })
            .collect();
    }
    obj.extract::<Vec<i32>>()
        .map_err(|_| PyTypeError::new_err(format!("{name} must be a 1-D int32 numpy array")))
}

/// `commit`'s logprobs: (chosen float32 [T], top_ids int32 [T, K], top_logprobs float32 [T, K]).
fn step_logprobs(obj: &Bound<'_, PyAny>) -> PyResult<StepLogprobs> {
    let (chosen, ids, lps): (
        PyReadonlyArray1<'_, f32>,
        PyReadonlyArray2<'_, i32>,
        PyReadonlyArray2<'_, f32>,
    ) = obj.extract().map_err(|_| {
        PyTypeError::new_err(
            "logprobs must be (float32 [T], int32 [T, K], float32 [T, K]) numpy arrays",
        )
    })?;
    if ids.shape() != lps.shape() {
        return Err(PyValueError::new_err(
            "logprobs: top_ids and top_logprobs differ in shape",
        ));
    }
    Ok(StepLogprobs {
        chosen: chosen.as_array().to_vec(),
        top_ids: ids.as_array().iter().copied().collect(),
        top_logprobs: lps.as_array().iter().copied().collect(),
        k: ids.shape()[1],
    })
}

/// `commit`'s prompt logprobs: (row_counts int32 [B], positions int32 [N], then the three
/// arrays of `step_logprobs` over the N entries).
fn prompt_lps(obj: &Bound<'_, PyAny>) -> PyResult<PromptLogprobs> {
    let bad = || PyTypeError::new_err("prompt_logprobs must be a 5-tuple of numpy arrays");
    let items: Vec<Bound<'_, PyAny>> = obj.extract().map_err(|_| bad())?;
    let [counts, positions, chosen, ids, lps] = items.as_slice() else {
        return Err(bad());
    };
    let triple = pyo3::types::PyTuple::new(obj.py(), [chosen, ids, lps])?;
    Ok(PromptLogprobs {
        row_counts: int32_vec(counts, "prompt_logprobs row_counts")?,
        positions: int32_vec(positions, "prompt_logprobs positions")?,
        entries: step_logprobs(triple.as_any())?,
    })
}

#[pyclass(module = "eaglebatch._native", name = "Scheduler")]
pub struct PyScheduler {
    inner: Run,
}

#[pymethods]
impl PyScheduler {
    /// `config`: an `eaglebatch.job.scheduler_config.SchedulerConfig` (any object with its
    /// attributes); validated by `Run::new`.
    #[new]
    fn new(py: Python<'_>, config: scheduler_config::PyConfig) -> PyResult<Self> {
        let inner = py.detach(|| Run::new(config.0)).map_err(to_py)?;
        Ok(PyScheduler { inner })
    }

    fn next_plan(&mut self, py: Python<'_>) -> PyResult<Option<PyStepPlan>> {
        let inner = &mut self.inner;
        match py.detach(|| inner.next_plan()).map_err(to_py)? {
            Some(plan) => Ok(Some(PyStepPlan::new(py, plan)?)),
            None => Ok(None),
        }
    }

    #[pyo3(signature = (tokens, num_tokens, num_accepted = None, logprobs = None, prompt_logprobs = None, pooled = None))]
    #[allow(clippy::too_many_arguments)]
    fn commit(
        &mut self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        num_tokens: &Bound<'_, PyAny>,
        num_accepted: Option<&Bound<'_, PyAny>>,
        logprobs: Option<&Bound<'_, PyAny>>,
        prompt_logprobs: Option<&Bound<'_, PyAny>>,
        pooled: Option<PyReadonlyArray2<'_, f32>>,
    ) -> PyResult<()> {
        let tokens = int32_vec(tokens, "tokens")?;
        let num_tokens = int32_vec(num_tokens, "num_tokens")?;
        let num_accepted = match num_accepted {
            Some(a) if !a.is_none() => Some(int32_vec(a, "num_accepted")?),
            _ => None,
        };
        let logprobs = match logprobs {
            Some(l) if !l.is_none() => Some(step_logprobs(l)?),
            _ => None,
        };
        let prompt_logprobs = match prompt_logprobs {
            Some(l) if !l.is_none() => Some(prompt_lps(l)?),
            _ => None,
        };
        let pooled = pooled.map(|a| PooledSums {
            rows: a.shape()[0],
            width: a.shape()[1],
            values: a.as_array().iter().copied().collect(),
        });
        let inner = &mut self.inner;
        py.detach(|| {
            inner.commit_pooled(
                &tokens,
                &num_tokens,
                num_accepted.as_deref(),
                logprobs.as_ref(),
                prompt_logprobs.as_ref(),
                pooled.as_ref(),
            )
        })
        .map_err(to_py)
    }

    fn next_plan_ahead(&mut self, py: Python<'_>) -> PyResult<Option<PyStepPlan>> {
        let inner = &mut self.inner;
        match py.detach(|| inner.next_plan_ahead()).map_err(to_py)? {
            Some(plan) => Ok(Some(PyStepPlan::new(py, plan)?)),
            None => Ok(None),
        }
    }

    /// Structured output: the pending verify plan's constrained rows, their valid draft
    /// counts and their masks per verify position, given the worker's drafts int64 [B, k]
    /// (`Run::draft_masks`): (rows int32 [R], valid int32 [R], masks uint32 [R, k+1,
    /// words]).
    #[allow(clippy::type_complexity)]
    fn draft_masks<'py>(
        &mut self,
        py: Python<'py>,
        drafts: PyReadonlyArray2<'py, i64>,
    ) -> PyResult<(
        Bound<'py, PyArray1<i32>>,
        Bound<'py, PyArray1<i32>>,
        Bound<'py, numpy::PyArray3<u32>>,
    )> {
        let k = drafts.shape()[1];
        let flat: Vec<i64> = drafts.as_array().iter().copied().collect();
        let inner = &mut self.inner;
        let m = py.detach(|| inner.draft_masks(&flat, k)).map_err(to_py)?;
        let r = m.rows.len();
        let words = m.words.max(1);
        let masks = m.masks.into_pyarray(py).reshape([r, k + 1, words])?;
        Ok((m.rows.into_pyarray(py), m.valid.into_pyarray(py), masks))
    }

    /// Structured output, masked drafting (`Run::draft_step_masks`): `tokens` None starts
    /// a session over the pending verify plan, else int64 [B] the drafts just chosen; returns
    /// (rows int32 [R], masks uint32 [R, words]) at the next draft position.
    #[pyo3(signature = (tokens = None))]
    #[allow(clippy::type_complexity)]
    fn draft_step_masks<'py>(
        &mut self,
        py: Python<'py>,
        tokens: Option<PyReadonlyArray1<'py, i64>>,
    ) -> PyResult<(Bound<'py, PyArray1<i32>>, Bound<'py, PyArray2<u32>>)> {
        let tokens: Option<Vec<i64>> = tokens.map(|t| t.as_array().to_vec());
        let inner = &mut self.inner;
        let (rows, masks) = py
            .detach(|| inner.draft_step_masks(tokens.as_deref()))
            .map_err(to_py)?;
        let words = if rows.is_empty() {
            1
        } else {
            masks.len() / rows.len()
        };
        let r = rows.len();
        let masks = masks.into_pyarray(py).reshape([r, words])?;
        Ok((rows.into_pyarray(py), masks))
    }

    fn set_plain_steps(&mut self, on: bool) {
        self.inner.set_plain_steps(on);
    }

    fn progress<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in self.inner.progress() {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    fn abort<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let inner = &mut self.inner;
        let written = py.detach(|| inner.abort()).map_err(to_py)?;
        let d = PyDict::new(py);
        d.set_item("rows_written", written.rows_written)?;
        d.set_item("writer_seconds", written.busy.as_secs_f64())?;
        let parts: Vec<String> = written
            .part_files
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        d.set_item("part_files", PyList::new(py, parts)?)?;
        Ok(d)
    }

    fn finish<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let inner = &mut self.inner;
        let summary = py.detach(|| inner.finish()).map_err(to_py)?;
        let d = PyDict::new(py);
        for (k, v) in summary {
            match v {
                SummaryValue::Int(i) => d.set_item(k, i)?,
                SummaryValue::Float(f) => d.set_item(k, f)?,
                SummaryValue::Paths(p) => d.set_item(k, PyList::new(py, p)?)?,
            }
        }
        Ok(d)
    }
}

/// Structured output: raises UserInputError when a job's response_format (a mapping, read as
/// the scheduler config reads it) does not parse or compile for the tokenizer file; called
/// before the model loads.
#[pyfunction]
fn check_response_format(
    py: Python<'_>,
    format: &Bound<'_, PyAny>,
    tokenizer_file: std::path::PathBuf,
    vocab_size: usize,
    eos_token_ids: Vec<u32>,
) -> PyResult<()> {
    let text = scheduler_config::json_text(format)?;
    py.detach(|| {
        crate::structured::check_job_format(&text, &tokenizer_file, vocab_size, &eos_token_ids)
    })
    .map_err(to_py)
}

/// The names of the columns a job's output has before its kept input columns (`config`: a
/// `SchedulerConfig` or any object with its attributes), as the writer will write them:
/// `output.keep_columns` may take any other name.
#[pyfunction]
fn output_columns(config: scheduler_config::PyConfig) -> Vec<String> {
    config.0.own_output_columns()
}

/// Renders a Hugging Face chat template (minijinja); exposed for parity tests.
#[pyfunction]
#[pyo3(signature = (template, messages, add_generation_prompt, bos_token, eos_token))]
fn render_chat_template(
    py: Python<'_>,
    template: String,
    messages: Vec<Bound<'_, PyDict>>,
    add_generation_prompt: bool,
    bos_token: Option<String>,
    eos_token: Option<String>,
) -> PyResult<String> {
    let mut msgs: Vec<Message> = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let mut fields = Vec::with_capacity(m.len());
        for (k, v) in m.iter() {
            let key: String = k
                .extract()
                .map_err(|_| PyTypeError::new_err(format!("messages[{i}]: keys must be str")))?;
            let value = if v.is_none() {
                None
            } else if let Ok(s) = v.cast::<PyString>() {
                Some(s.to_str()?.to_string())
            } else {
                return Err(PyTypeError::new_err(format!(
                    "messages[{i}][{key:?}]: values must be str or None"
                )));
            };
            fields.push((key, value));
        }
        msgs.push(fields);
    }
    py.detach(|| {
        chat_template::render_chat_template(
            &template,
            &msgs,
            add_generation_prompt,
            bos_token.as_deref(),
            eos_token.as_deref(),
        )
    })
    .map_err(to_py)
}

/// Compiles a chat template as the reader would (nothing is rendered); a template that does not
/// compile raises ValueError with minijinja's message. `validate` and `prepare` call it so a
/// broken template fails the job before any model is loaded.
#[pyfunction]
fn check_chat_template(py: Python<'_>, template: String) -> PyResult<()> {
    py.detach(|| chat_template::ChatTemplate::new(&template).map(drop))
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// Whether a storage option's name names a credential: the rule storage.rs redacts by.
#[pyfunction]
fn is_secret_name(name: &str) -> bool {
    crate::storage::is_secret_name(name)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("NativeError", py.get_type::<NativeError>())?;
    m.add("UserInputError", py.get_type::<UserInputError>())?;
    m.add(
        "StorageConflict",
        py.get_type::<crate::exceptions::StorageConflict>(),
    )?;
    m.add_class::<object_store::PyObjectStore>()?;
    m.add_class::<object_store::PyRemoteFile>()?;
    m.add_class::<PyScheduler>()?;
    m.add_class::<PyStepPlan>()?;
    m.add_function(wrap_pyfunction!(render_chat_template, m)?)?;
    m.add_function(wrap_pyfunction!(check_chat_template, m)?)?;
    m.add_function(wrap_pyfunction!(check_response_format, m)?)?;
    m.add_function(wrap_pyfunction!(is_secret_name, m)?)?;
    m.add("JSON_WHITESPACE", crate::structured::JSON_WHITESPACE)?;
    m.add("MOST_ALTERNATIVES", crate::structured::MOST_ALTERNATIVES)?;
    m.add_function(wrap_pyfunction!(output_columns, m)?)?;
    m.add("OUTPUT_COLUMNS", crate::writer::OUTPUT_COLUMNS.to_vec())?;
    m.add("STATE_CONTINUE", crate::scheduler::STATE_CONTINUE)?;
    m.add("STATE_ZERO", crate::scheduler::STATE_ZERO)?;
    m.add("SCHEDULER_CONFIG_FIELDS", scheduler_config::FIELDS.to_vec())?;
    inputs::register(m)?;
    crate::cpu::bindings::register(m)
}
