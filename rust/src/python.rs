//! PyO3 bindings: module `eaglebatch._native` (contract: `py/eaglebatch/_native.pyi`).
//!
//! Thin by design: argument conversion, GIL release around every call into the core, numpy
//! arrays out, and the one place where `Error` becomes a Python exception
//! (`UserInput` -> `UserInputError`, everything else -> `NativeError`).

use numpy::{
    IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2,
    PyUntypedArrayMethods,
};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};

use crate::chat_template::{self, Message};
use crate::config::SchedulerConfig;
use crate::decoder_layer as layers;
use crate::error::Error;
use crate::logprobs::{PromptLogprobs, StepLogprobs};
use crate::paged_attention as attn;
use crate::quant::WeightType;
use crate::scheduler::{Scheduler, StepPlan};
use crate::small_gemm as gemm;
use crate::stats::SummaryValue;

create_exception!(
    eaglebatch._native,
    NativeError,
    PyException,
    "Any error raised by the Rust side (bad input file, missing column, tokenizer, I/O)."
);
create_exception!(
    eaglebatch._native,
    UserInputError,
    NativeError,
    "An error the user can fix (missing file / column, wrong column type): message names it."
);

fn to_py(e: Error) -> PyErr {
    match e {
        Error::UserInput(msg) => UserInputError::new_err(msg),
        other => NativeError::new_err(other.to_string()),
    }
}

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
            penalty_ids: p.penalty_ids.into_pyarray(py).unbind(),
            cu_penalty: p.cu_penalty.into_pyarray(py).unbind(),
            penalty_prompt_lens: p.penalty_prompt_lens.into_pyarray(py).unbind(),
            prefix_ids: p.prefix_ids.into_pyarray(py).unbind(),
            cu_prefix: p.cu_prefix.into_pyarray(py).unbind(),
            block_copies: copies.unbind(),
            next_ids: p.next_ids.into_pyarray(py).unbind(),
            prev_rows: p.prev_rows.into_pyarray(py).unbind(),
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

/// A 1-D int64 array (numpy int64 preferred; other integer numpy arrays and Python sequences
/// of ints are accepted).
/// `SchedulerConfig.skip_rows`: an int64 (or int32) numpy array, a sequence of ints, or None.
pub(crate) fn int64_array(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    if obj.is_none() {
        return Ok(Vec::new());
    }
    int64_vec(obj, "skip_rows")
}

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
    inner: Scheduler,
}

#[pymethods]
impl PyScheduler {
    /// `config`: an `eaglebatch.scheduler_config.SchedulerConfig` (any object with its
    /// attributes); validated by `Scheduler::new`.
    #[new]
    fn new(py: Python<'_>, config: SchedulerConfig) -> PyResult<Self> {
        let inner = py.detach(|| Scheduler::new(config)).map_err(to_py)?;
        Ok(PyScheduler { inner })
    }

    fn next_plan(&mut self, py: Python<'_>) -> PyResult<Option<PyStepPlan>> {
        let inner = &mut self.inner;
        match py.detach(|| inner.next_plan()).map_err(to_py)? {
            Some(plan) => Ok(Some(PyStepPlan::new(py, plan)?)),
            None => Ok(None),
        }
    }

    #[pyo3(signature = (tokens, num_tokens, num_accepted = None, logprobs = None, prompt_logprobs = None))]
    fn commit(
        &mut self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        num_tokens: &Bound<'_, PyAny>,
        num_accepted: Option<&Bound<'_, PyAny>>,
        logprobs: Option<&Bound<'_, PyAny>>,
        prompt_logprobs: Option<&Bound<'_, PyAny>>,
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
        let inner = &mut self.inner;
        py.detach(|| {
            inner.commit(
                &tokens,
                &num_tokens,
                num_accepted.as_deref(),
                logprobs.as_ref(),
                prompt_logprobs.as_ref(),
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

/// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight over `rows` rows of `h` values, by raw
/// addresses like `small_gemm`: a draft head's RMSNorm of a few CPU rows, which torch runs as
/// several small ops (~20 µs, ~100 µs between a verify round's kernels). The caller
/// (`model/llama.py::RMSNorm`) guarantees: x and out are live, C-contiguous float32 buffers of
/// rows x h elements that do not overlap, weight one of h.
#[pyfunction]
fn rms_norm(
    py: Python<'_>,
    x: usize,
    weight: usize,
    out: usize,
    rows: usize,
    h: usize,
    eps: f32,
) -> PyResult<()> {
    let len = rows
        .checked_mul(h)
        .filter(|&n| n <= isize::MAX as usize / 4);
    let Some(len) = len.filter(|_| rows > 0 && h > 0 && x != 0 && weight != 0 && out != 0) else {
        return Err(PyValueError::new_err(format!(
            "rms_norm: {rows} x {h}: need rows, h >= 1, a size that fits in memory and \
             non-null buffers"
        )));
    };
    py.detach(|| {
        // SAFETY: the caller's guarantee above (documented in the .pyi as well).
        let (x, weight, out) = unsafe {
            (
                std::slice::from_raw_parts(x as *const f32, len),
                std::slice::from_raw_parts(weight as *const f32, h),
                std::slice::from_raw_parts_mut(out as *mut f32, len),
            )
        };
        crate::decoder_layer::rms_norm(x, weight, eps, out)
    });
    Ok(())
}

/// out = x @ w.T (see `small_gemm`) over raw addresses, because converting three torch tensors
/// to numpy arrays costs more (~5 µs) than a small GEMM call's whole budget. `weight_type`:
/// the GGML type number of w's format (`quant::WeightType`: 0 float32, 30 bfloat16, GGUF
/// block types). The caller (`cpu/gemm.py`, the only one) guarantees: x, w and out are live,
/// C-contiguous CPU buffers of m x k float32, n rows of that format's `row_bytes(k)` bytes and
/// m x n float32 elements, and out does not overlap x or w.
#[pyfunction]
#[pyo3(signature = (x, w, out, m, n, k, threads, weight_type = 0))]
#[allow(clippy::too_many_arguments)]
fn small_gemm(
    py: Python<'_>,
    x: usize,
    w: usize,
    out: usize,
    m: usize,
    n: usize,
    k: usize,
    threads: usize,
    weight_type: u32,
) -> PyResult<()> {
    if !gemm::available() {
        return Err(NativeError::new_err(
            "small_gemm: this CPU has neither AVX-512F nor AVX2 with FMA",
        ));
    }
    let ty = weight_type_of(weight_type)?;
    let row_bytes = ty.row_bytes(k).filter(|_| n > 0);
    if !(1..=gemm::MAX_ROWS).contains(&m) || row_bytes.is_none() || x == 0 || w == 0 || out == 0 {
        return Err(PyValueError::new_err(format!(
            "small_gemm: {m} x {k} @ ({n} x {k} {ty:?})^T: need 1 <= m <= {}, n >= 1, k a \
             positive whole number of blocks, non-null buffers",
            gemm::MAX_ROWS
        )));
    }
    let w_len = n * row_bytes.unwrap_or_default();
    py.detach(|| {
        // SAFETY: the caller's guarantee above (documented in the .pyi as well).
        let (x, w, out) = unsafe {
            (
                std::slice::from_raw_parts(x as *const f32, m * k),
                std::slice::from_raw_parts(w as *const u8, w_len),
                std::slice::from_raw_parts_mut(out as *mut f32, m * n),
            )
        };
        gemm::linear_typed(ty, x, w, out, (m, n, k), threads)
    });
    Ok(())
}

/// The weight format of GGML type number `id`, or the error naming it.
fn weight_type_of(id: u32) -> PyResult<WeightType> {
    WeightType::from_ggml(id).ok_or_else(|| {
        PyValueError::new_err(format!("GGML type {id} is not one the CPU kernels read"))
    })
}

/// out[i] = row ids[i] of w (`small_gemm::gather_rows`: an embedding lookup from weights of
/// GGML type `weight_type`), by raw addresses like `small_gemm`. The caller (`cpu/quantized.py`)
/// guarantees w is a live buffer of `rows` rows of `row_bytes(k)` bytes and out one of
/// len(ids) x k float32 not overlapping it; every id is checked against `rows`.
#[pyfunction]
fn gather_rows(
    py: Python<'_>,
    w: usize,
    weight_type: u32,
    rows: usize,
    k: usize,
    ids: PyReadonlyArray1<'_, i64>,
    out: usize,
) -> PyResult<()> {
    let ty = weight_type_of(weight_type)?;
    let ids = ids
        .as_slice()
        .map_err(|_| PyValueError::new_err("gather_rows: ids must be C-contiguous"))?;
    let Some(row_bytes) = ty
        .row_bytes(k)
        .filter(|_| w != 0 && out != 0 && gemm::available())
    else {
        return Err(PyValueError::new_err(format!(
            "gather_rows: k = {k} is not a whole number of {ty:?} blocks, a buffer is null or \
             this CPU cannot run the kernels"
        )));
    };
    if let Some(bad) = ids.iter().find(|&&i| i < 0 || i as usize >= rows) {
        return Err(PyValueError::new_err(format!(
            "gather_rows: id {bad} outside 0..{rows}"
        )));
    }
    py.detach(|| {
        // SAFETY: the caller's guarantee above.
        let (w, out) = unsafe {
            (
                std::slice::from_raw_parts(w as *const u8, rows * row_bytes),
                std::slice::from_raw_parts_mut(out as *mut f32, ids.len() * k),
            )
        };
        gemm::gather_rows(ty, w, k, ids, out)
    });
    Ok(())
}

/// Paged attention of a decode or verify step (see `paged_attention`). q, kv_cache and out are
/// raw addresses (tensor.data_ptr()) for the same reason as `small_gemm`; the caller
/// (`attention/cpu_backend.py`) guarantees live, C-contiguous float32 CPU buffers of
/// [num_tokens, num_heads, head_dim] (q, out; out not overlapping the others) and
/// [2, num_blocks, block_size, num_kv_heads, head_dim] (kv_cache). The index arrays are numpy
/// and every index is checked before anything is read.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn paged_attention(
    py: Python<'_>,
    q: usize,
    kv_cache: usize,
    out: usize,
    num_tokens: usize,
    cu_seqlens_q: PyReadonlyArray1<'_, i32>,
    seq_lens: PyReadonlyArray1<'_, i32>,
    block_tables: PyReadonlyArray2<'_, i32>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    num_blocks: usize,
    scale: f32,
    threads: usize,
) -> PyResult<()> {
    if q == 0 || kv_cache == 0 || out == 0 {
        return Err(PyValueError::new_err("paged_attention: null buffer"));
    }
    let layout = attn::Layout {
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks,
        max_blocks: block_tables.shape()[1],
    };
    let contiguous =
        |name: &str| PyValueError::new_err(format!("paged_attention: {name} must be C-contiguous"));
    let step = attn::Step {
        cu_seqlens_q: cu_seqlens_q
            .as_slice()
            .map_err(|_| contiguous("cu_seqlens_q"))?,
        seq_lens: seq_lens.as_slice().map_err(|_| contiguous("seq_lens"))?,
        block_tables: block_tables
            .as_slice()
            .map_err(|_| contiguous("block_tables"))?,
    };
    let q_len = num_tokens * num_heads * head_dim;
    let cache_len = 2 * num_blocks * block_size * num_kv_heads * head_dim;
    py.detach(|| {
        // SAFETY: the caller's guarantee above (documented in the .pyi as well).
        let (q, kv_cache, out) = unsafe {
            (
                std::slice::from_raw_parts(q as *const f32, q_len),
                std::slice::from_raw_parts(kv_cache as *const f32, cache_len),
                std::slice::from_raw_parts_mut(out as *mut f32, q_len),
            )
        };
        attn::attend(q, kv_cache, out, &layout, &step, scale, threads)
    })
    .map_err(|e| PyValueError::new_err(format!("paged_attention: {e}")))
}

/// Addresses of one decoder layer's tensors, in this order: input_norm (0: none, the layer
/// is given its input), q, k, v, o, post_norm, gate, up, down weights, then the biases of q,
/// k, v, o, gate, up, down (0: none), then the per-head q and k norm weights [D] (0: none).
const LAYER_TENSORS: usize = 18;

/// A model's decoder layers for the few-row CPU path (`decoder_layer`), held as raw addresses
/// (tensor.data_ptr()) so that a step pays no conversion per tensor. The caller
/// (`model/native_decoder.py`, the only one) keeps every tensor alive and unchanged while this
/// object exists, all float32 but the weights, whose format is given per projection in
/// `weight_types` (GGML type numbers: float32, bfloat16 bits or GGUF blocks, n rows of
/// `row_bytes(k)` bytes), C-contiguous and of the documented shapes; the RoPE tables are
/// [max_positions, head_dim].
#[pyclass(frozen)]
struct CpuDecoder {
    layers: Vec<[usize; LAYER_TENSORS]>,
    weight_types: Vec<[WeightType; 7]>,
    /// Input features of each layer's q/k/v (the hidden size, or wider for a draft layer
    /// whose input the caller builds).
    in_features: Vec<usize>,
    hidden: usize,
    intermediate: usize,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    eps: f32,
    scale: f32,
    rope: (usize, usize, usize),
}

#[pymethods]
impl CpuDecoder {
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        layers: Vec<Vec<usize>>,
        weight_types: Vec<Vec<u32>>,
        in_features: Vec<usize>,
        hidden: usize,
        intermediate: usize,
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        eps: f32,
        scale: f32,
        cos: usize,
        sin: usize,
        max_positions: usize,
    ) -> PyResult<Self> {
        let bad = |what: &str| PyValueError::new_err(format!("CpuDecoder: {what}"));
        if layers.len() != weight_types.len() || layers.len() != in_features.len() {
            return Err(bad(
                "layers, weight_types and in_features must have one entry per layer",
            ));
        }
        if hidden == 0 || intermediate == 0 || num_heads == 0 || num_kv_heads == 0 {
            return Err(bad("sizes must be positive"));
        }
        if head_dim == 0 || !head_dim.is_multiple_of(2) || head_dim > attn::MAX_HEAD_DIM {
            return Err(bad("head_dim must be even and at most 256"));
        }
        if cos == 0 || sin == 0 || max_positions == 0 {
            return Err(bad("null RoPE table"));
        }
        let mut table = Vec::with_capacity(layers.len());
        for (i, l) in layers.iter().enumerate() {
            let addrs: [usize; LAYER_TENSORS] = l
                .as_slice()
                .try_into()
                .map_err(|_| bad(&format!("layer {i}: {LAYER_TENSORS} addresses expected")))?;
            if addrs[1..9].contains(&0) {
                return Err(bad(&format!("layer {i}: null weight")));
            }
            table.push(addrs);
        }
        let types = weight_types
            .iter()
            .map(|ids| layer_weight_types(ids))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(Self {
            layers: table,
            weight_types: types,
            in_features,
            hidden,
            intermediate,
            num_heads,
            num_kv_heads,
            head_dim,
            eps,
            scale,
            rope: (cos, sin, max_positions),
        })
    }

    /// Runs layers first..last over x [T, hidden] in place (see `decoder_layer::forward`);
    /// `input` (address, 0: none) is the first layer's attention input [T, in_features].
    /// kv_caches: the addresses of those layers' caches [2, num_blocks, block_size, Hkv, D].
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (x, input, first, last, positions, slot_mapping, cu_seqlens_q, seq_lens,
                        block_tables, kv_caches, num_blocks, block_size, threads))]
    fn forward(
        &self,
        py: Python<'_>,
        x: usize,
        input: usize,
        first: usize,
        last: usize,
        positions: PyReadonlyArray1<'_, i64>,
        slot_mapping: PyReadonlyArray1<'_, i64>,
        cu_seqlens_q: PyReadonlyArray1<'_, i32>,
        seq_lens: PyReadonlyArray1<'_, i32>,
        block_tables: PyReadonlyArray2<'_, i32>,
        kv_caches: Vec<usize>,
        num_blocks: usize,
        block_size: usize,
        threads: usize,
    ) -> PyResult<()> {
        let err = |e: String| PyValueError::new_err(format!("CpuDecoder.forward: {e}"));
        let positions = contiguous("positions", positions.as_slice())?;
        let slot_mapping = contiguous("slot_mapping", slot_mapping.as_slice())?;
        let step = attn::Step {
            cu_seqlens_q: contiguous("cu_seqlens_q", cu_seqlens_q.as_slice())?,
            seq_lens: contiguous("seq_lens", seq_lens.as_slice())?,
            block_tables: contiguous("block_tables", block_tables.as_slice())?,
        };
        let call = Call {
            x,
            input,
            layers: first..last,
            kv_caches: &kv_caches,
            num_blocks,
            block_size,
            rows: positions.len(),
        };
        self.check(&call).map_err(err)?;
        let max_blocks = block_tables.shape()[1];
        py.detach(|| {
            // SAFETY: the caller's guarantee in the class doc: live tensors of these sizes.
            unsafe {
                let mut run = self.layer_views(&call);
                let (cos, sin, max_positions) = self.rope;
                let d = self.head_dim;
                let rows = layers::Rows {
                    positions,
                    slot_mapping,
                    step,
                    max_blocks,
                    cos: f32_slice(cos, max_positions * d),
                    sin: f32_slice(sin, max_positions * d),
                };
                let x = std::slice::from_raw_parts_mut(x as *mut f32, call.rows * self.hidden);
                let in0 = self.in_features[first];
                let input = (input != 0).then(|| f32_slice(input, call.rows * in0));
                let shape = self.shape(num_blocks, block_size);
                layers::forward(&mut run, &shape, &rows, x, input, threads)
            }
        })
        .map_err(err)
    }
}

/// One layer's seven weight formats from their GGML type numbers.
fn layer_weight_types(ids: &[u32]) -> PyResult<[WeightType; 7]> {
    let ids: [u32; 7] = ids
        .try_into()
        .map_err(|_| PyValueError::new_err("CpuDecoder: 7 weight types per layer expected"))?;
    let mut layer = [WeightType::F32; 7];
    for (t, id) in layer.iter_mut().zip(ids) {
        *t = weight_type_of(id)?;
    }
    Ok(layer)
}

/// A numpy array's data as a slice, or the error naming the argument that is not contiguous.
fn contiguous<'a, T>(
    name: &str,
    r: std::result::Result<&'a [T], numpy::AsSliceError>,
) -> PyResult<&'a [T]> {
    r.map_err(|_| PyValueError::new_err(format!("CpuDecoder.forward: {name} must be C-contiguous")))
}

/// One `CpuDecoder.forward` call's buffers and sizes (addresses as given by the caller).
struct Call<'a> {
    x: usize,
    input: usize,
    layers: std::ops::Range<usize>,
    kv_caches: &'a [usize],
    num_blocks: usize,
    block_size: usize,
    rows: usize,
}

/// # Safety
/// `addr` is the address of `len` live f32 values (the caller's guarantee, `CpuDecoder`).
unsafe fn f32_slice<'a>(addr: usize, len: usize) -> &'a [f32] {
    unsafe { std::slice::from_raw_parts(addr as *const f32, len) }
}

impl CpuDecoder {
    /// The argument rules of `forward`, checked before any address is read.
    fn check(&self, c: &Call<'_>) -> Result<(), String> {
        let (first, last) = (c.layers.start, c.layers.end);
        if first >= last || last > self.layers.len() || c.kv_caches.len() != last - first {
            return Err(format!(
                "layers {first}..{last} of {} need one KV cache each",
                self.layers.len()
            ));
        }
        if c.x == 0 || c.kv_caches.contains(&0) || c.block_size == 0 || c.num_blocks == 0 {
            return Err("null buffer or empty cache".into());
        }
        if !(1..=gemm::MAX_ROWS).contains(&c.rows) {
            return Err(format!("{} rows: 1..={} supported", c.rows, gemm::MAX_ROWS));
        }
        if first > 0 && c.input != 0 {
            return Err("an input is only given to layer 0".into());
        }
        // layers that norm x themselves read `hidden` features
        if (first..last).any(|i| (i != first || c.input == 0) && self.in_features[i] != self.hidden)
        {
            return Err("a layer wider than the hidden size needs an input".into());
        }
        Ok(())
    }

    fn shape(&self, num_blocks: usize, block_size: usize) -> layers::Shape {
        layers::Shape {
            hidden: self.hidden,
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            eps: self.eps,
            scale: self.scale,
            block_size,
            num_blocks,
        }
    }

    /// Slices over the tensors of layers `c.layers`, each with its KV cache.
    ///
    /// # Safety
    /// The addresses are live tensors of the documented sizes (the class doc).
    unsafe fn layer_views<'a>(&self, c: &Call<'_>) -> Vec<layers::Layer<'a>> {
        let d = self.head_dim;
        let (h, inner) = (self.hidden, self.intermediate);
        let (q_size, kv_size) = (self.num_heads * d, self.num_kv_heads * d);
        let cache_len = 2 * c.num_blocks * c.block_size * kv_size;
        c.layers
            .clone()
            .zip(c.kv_caches)
            .map(|(i, &cache)| {
                let (a, ty, q_in) = (self.layers[i], self.weight_types[i], self.in_features[i]);
                // SAFETY: as this function's.
                unsafe {
                    let proj = |j: usize, n: usize, k: usize| projection(a, ty, j, n, k);
                    layers::Layer {
                        input_norm: (a[0] != 0).then(|| f32_slice(a[0], h)),
                        q_norm: (a[16] != 0).then(|| f32_slice(a[16], d)),
                        k_norm: (a[17] != 0).then(|| f32_slice(a[17], d)),
                        q: proj(0, q_size, q_in),
                        k: proj(1, kv_size, q_in),
                        v: proj(2, kv_size, q_in),
                        o: proj(3, h, q_size),
                        post_norm: f32_slice(a[5], h),
                        gate: proj(4, inner, h),
                        up: proj(5, inner, h),
                        down: proj(6, h, inner),
                        kv_cache: std::slice::from_raw_parts_mut(cache as *mut f32, cache_len),
                    }
                }
            })
            .collect()
    }
}

/// Projection `j` (q, k, v, o, gate, up, down) of a layer's addresses `a`: its weight [n, k]
/// (of format `ty[j]`) and bias [n] (address 0: none).
///
/// # Safety
/// The addresses are live tensors of those sizes.
unsafe fn projection<'a>(
    a: [usize; LAYER_TENSORS],
    ty: [WeightType; 7],
    j: usize,
    n: usize,
    k: usize,
) -> layers::Proj<'a> {
    let w = a[[1, 2, 3, 4, 6, 7, 8][j]]; // projection j's weight address
    let ty = ty[j];
    let len = n * ty.row_bytes(k).unwrap_or_default(); // `check_layer` refuses a bad k
                                                       // SAFETY: as this function's.
    unsafe {
        let b = a[9 + j];
        layers::Proj {
            weight: layers::Weight {
                ty,
                bytes: std::slice::from_raw_parts(w as *const u8, len),
            },
            bias: (b != 0).then(|| f32_slice(b, n)),
            n,
            k,
        }
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("NativeError", py.get_type::<NativeError>())?;
    m.add("UserInputError", py.get_type::<UserInputError>())?;
    m.add_class::<PyScheduler>()?;
    m.add_class::<PyStepPlan>()?;
    m.add_class::<CpuDecoder>()?;
    m.add_function(wrap_pyfunction!(render_chat_template, m)?)?;
    m.add_function(wrap_pyfunction!(check_chat_template, m)?)?;
    m.add_function(wrap_pyfunction!(small_gemm, m)?)?;
    m.add_function(wrap_pyfunction!(gather_rows, m)?)?;
    m.add_function(wrap_pyfunction!(rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(paged_attention, m)?)?;
    m.add("OUTPUT_COLUMNS", crate::writer::OUTPUT_COLUMNS.to_vec())?;
    m.add("SMALL_GEMM_AVAILABLE", gemm::available())?;
    m.add("SMALL_GEMM_MAX_ROWS", gemm::MAX_ROWS)?;
    Ok(())
}
