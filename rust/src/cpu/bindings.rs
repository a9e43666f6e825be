//! PyO3 bindings of the CPU kernels (contract: `py/eaglebatch/_native.pyi`): functions over raw
//! buffer addresses, each checking its sizes and indices before anything is read (`moe_experts`
//! in `moe`), and the `CpuDecoder` class (`cpu_decoder`). `register` adds them to
//! `eaglebatch._native`.

use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::cpu::delta_rule;
use crate::cpu::int8_gemm::{self, Activations};
use crate::cpu::paged_attention as attn;
use crate::cpu::quant::WeightType;
use crate::cpu::small_gemm as gemm;
use crate::exceptions::NativeError;

mod cpu_decoder;
mod moe;

/// Adds the kernels' functions, classes and constants to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<cpu_decoder::CpuDecoder>()?;
    m.add_function(wrap_pyfunction!(small_gemm, m)?)?;
    m.add_function(wrap_pyfunction!(gather_rows, m)?)?;
    m.add_function(wrap_pyfunction!(rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(rms_norm_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(rotary_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(delta_rule_steps, m)?)?;
    m.add_function(wrap_pyfunction!(moe::moe_experts, m)?)?;
    m.add_function(wrap_pyfunction!(paged_attention, m)?)?;
    m.add("SMALL_GEMM_AVAILABLE", gemm::available())?;
    m.add("SMALL_GEMM_MAX_ROWS", gemm::MAX_ROWS)?;
    Ok(())
}

/// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight over `rows` rows of `h` values, by raw
/// addresses like `small_gemm`: a draft head's RMSNorm of a few CPU rows, which torch runs as
/// several small ops (~20 µs, ~100 µs between a verify round's kernels). The caller
/// (`cpu/norm.py`) guarantees: x and out are live, C-contiguous float32 buffers of
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
    let len = checked_len(rows, h, 4, [x, weight, out], "rms_norm")?;
    py.detach(|| {
        // SAFETY: the caller's guarantee above (documented in the .pyi as well).
        let (x, weight, out) = unsafe {
            (
                std::slice::from_raw_parts(x as *const f32, len),
                std::slice::from_raw_parts(weight as *const f32, h),
                std::slice::from_raw_parts_mut(out as *mut f32, len),
            )
        };
        crate::cpu::decoder_layer::rms_norm(x, weight, eps, out)
    });
    Ok(())
}

/// `rms_norm` over bfloat16 rows (`bf16_rows::rms_norm`, transformers' rounding), on up to
/// `threads` of torch's threads: a bfloat16 forward pass's norms. The caller
/// (`cpu/bf16_rows.py`) guarantees: x and out are live, C-contiguous bfloat16 buffers of
/// rows x h elements that do not overlap, weight one of h.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn rms_norm_bf16(
    py: Python<'_>,
    x: usize,
    weight: usize,
    out: usize,
    rows: usize,
    h: usize,
    eps: f32,
    threads: usize,
) -> PyResult<()> {
    let len = checked_len(rows, h, 2, [x, weight, out], "rms_norm_bf16")?;
    py.detach(|| {
        // SAFETY: the caller's guarantee above (documented in the .pyi as well).
        let (x, weight, out) = unsafe {
            (
                std::slice::from_raw_parts(x as *const u16, len),
                std::slice::from_raw_parts(weight as *const u16, h),
                std::slice::from_raw_parts_mut(out as *mut u16, len),
            )
        };
        crate::cpu::bf16_rows::rms_norm(x, weight, eps, out, threads)
    });
    Ok(())
}

/// RoPE of x [tokens, heads, d] by cos, sin [tokens, d] into out over bfloat16 values
/// (`bf16_rows::rotary`, torch's rounding), on up to `threads` of torch's threads. The caller
/// (`cpu/bf16_rows.py`) guarantees: x and out are live, C-contiguous bfloat16 buffers of
/// tokens x heads x d elements that do not overlap, cos and sin ones of tokens x d.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn rotary_bf16(
    py: Python<'_>,
    x: usize,
    cos: usize,
    sin: usize,
    out: usize,
    tokens: usize,
    heads: usize,
    d: usize,
    threads: usize,
) -> PyResult<()> {
    let table = checked_len(tokens, d, 2, [cos, sin, out], "rotary_bf16")?;
    let len = checked_len(table, heads, 2, [x, out, out], "rotary_bf16")?;
    if !d.is_multiple_of(2) {
        return Err(PyValueError::new_err(format!(
            "rotary_bf16: head size {d} is odd"
        )));
    }
    py.detach(|| {
        // SAFETY: the caller's guarantee above (documented in the .pyi as well).
        let (x, cos, sin, out) = unsafe {
            (
                std::slice::from_raw_parts(x as *const u16, len),
                std::slice::from_raw_parts(cos as *const u16, table),
                std::slice::from_raw_parts(sin as *const u16, table),
                std::slice::from_raw_parts_mut(out as *mut u16, len),
            )
        };
        crate::cpu::bf16_rows::rotary(x, (cos, sin), out, (heads, d), threads)
    });
    Ok(())
}

/// rows * h, checked to be a non-empty buffer of `itemsize`-byte elements that fits in memory,
/// with non-null addresses.
fn checked_len(
    rows: usize,
    h: usize,
    itemsize: usize,
    addrs: [usize; 3],
    what: &str,
) -> PyResult<usize> {
    rows.checked_mul(h)
        .filter(|&n| n <= isize::MAX as usize / itemsize)
        .filter(|_| rows > 0 && h > 0 && addrs.iter().all(|&a| a != 0))
        .ok_or_else(|| {
            PyValueError::new_err(format!(
                "{what}: {rows} x {h}: need rows, h >= 1, a size that fits in memory and \
                 non-null buffers"
            ))
        })
}

/// out = x @ w.T (see `small_gemm`) over raw addresses, because converting three torch tensors
/// to numpy arrays costs more (~5 µs) than a small GEMM call's whole budget. `weight_type`:
/// the GGML type number of w's format (`quant::WeightType`: 0 float32, 30 bfloat16, GGUF
/// block types). The callers (`cpu/gemm.py`, `cpu/quantized.py`) guarantee: x, w and out are
/// live, C-contiguous CPU buffers of m x k float32, n rows of that format's `row_bytes(k)`
/// bytes and m x n float32 elements, and out does not overlap x or w.
#[pyfunction]
#[pyo3(signature = (x, w, out, m, n, k, threads, weight_type = 0, int8_activations = false))]
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
    int8_activations: bool,
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
        let acts = Activations::int8_if(int8_activations);
        int8_gemm::linear_as(acts, ty, x, w, out, (m, n, k), threads)
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
/// (`cpu/attention.py`) guarantees live, C-contiguous float32 CPU buffers of
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

/// The gated delta rule's recurrent form (`cpu::delta_rule::steps`) over raw addresses:
/// `addrs` = [q, k, v, g, beta, states, o, after], float32 buffers of the shapes that module
/// states for rows of `lengths` tokens and (heads, dk, dv). The caller (`cpu/deltanet.py`)
/// guarantees: every buffer is live, C-contiguous and of exactly those sizes, and o and after
/// overlap nothing else. The sizes are checked against `lengths` here before anything is read.
#[pyfunction]
fn delta_rule_steps(
    py: Python<'_>,
    addrs: [usize; 8],
    lengths: Vec<usize>,
    heads: usize,
    dk: usize,
    dv: usize,
) -> PyResult<()> {
    let d = delta_rule::Dims { heads, dk, dv };
    let t = lengths.iter().try_fold(0usize, |a, &n| a.checked_add(n));
    let sizes = t.and_then(|t| {
        let th = t.checked_mul(heads)?;
        let per_row = heads.checked_mul(dk)?.checked_mul(dv)?;
        let n = [
            th.checked_mul(dk)?,
            th.checked_mul(dk)?,
            th.checked_mul(dv)?,
            th,
            th,
        ];
        let big = [
            lengths.len().checked_mul(per_row)?,
            n[2],
            t.checked_mul(per_row)?,
        ];
        Some((n, big)).filter(|_| big.iter().chain(&n).all(|&b| b <= isize::MAX as usize / 4))
    });
    let Some((n, big)) = sizes.filter(|_| addrs.iter().all(|&a| a != 0)) else {
        return Err(PyValueError::new_err(
            "delta_rule_steps: sizes that do not fit in memory, or a null buffer",
        ));
    };
    // SAFETY: the caller's guarantee above; every length is derived from `lengths` and dims.
    let f =
        |i: usize, len: usize| unsafe { std::slice::from_raw_parts(addrs[i] as *const f32, len) };
    let x = delta_rule::Inputs {
        q: f(0, n[0]),
        k: f(1, n[1]),
        v: f(2, n[2]),
        g: f(3, n[3]),
        beta: f(4, n[4]),
    };
    let states = f(5, big[0]);
    if let Some(e) = delta_rule::check_sizes(d, &lengths, &x, big[0], big[1], big[2]) {
        return Err(PyValueError::new_err(e));
    }
    py.detach(|| {
        // SAFETY: as above; o and after are the caller's output buffers, overlapping nothing.
        let (o, after) = unsafe {
            (
                std::slice::from_raw_parts_mut(addrs[6] as *mut f32, big[1]),
                std::slice::from_raw_parts_mut(addrs[7] as *mut f32, big[2]),
            )
        };
        delta_rule::steps(d, &lengths, &x, states, o, after)
    });
    Ok(())
}
