//! `moe_experts`: one mixture-of-experts layer's routed MLP over a step's rows (`cpu::moe`).

use numpy::{PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::weight_type_of;
use crate::cpu::int8_gemm::Activations;
use crate::cpu::moe::{self, Activation, Dims, Expert, Matrix, Plan, Routing};
use crate::cpu::small_gemm as gemm;
use crate::exceptions::NativeError;

/// out = the routed MLP of x (`cpu::moe`) by raw addresses like `small_gemm`. `experts` and
/// `weights` are the router's [T, k] choice; `matrices`, `types` and `biases` hold per expert
/// (rows) the gate, up and down weights' addresses, GGML types and bias addresses (0: none).
/// The caller (`cpu/moe.py`) guarantees: x and out are live C-contiguous float32 buffers of
/// T x hidden values, out overlapping nothing; each gate and up address a live buffer of
/// inner rows of `row_bytes(hidden)` bytes of its type, each down one of hidden rows of
/// `row_bytes(inner)`; each bias a float32 buffer of inner (gate, up) or hidden (down) values.
/// Every size, type and expert id is checked here before anything is read.
#[pyfunction]
#[pyo3(signature = (x, out, hidden, inner, experts, weights, matrices, types, biases,
                    activation = "silu", alpha = 1.702, limit = 7.0, threads = 1,
                    int8_activations = false, column_block = 0))]
#[allow(clippy::too_many_arguments)]
pub(super) fn moe_experts(
    py: Python<'_>,
    x: usize,
    out: usize,
    hidden: usize,
    inner: usize,
    experts: PyReadonlyArray2<'_, i64>,
    weights: PyReadonlyArray2<'_, f32>,
    matrices: PyReadonlyArray2<'_, u64>,
    types: PyReadonlyArray2<'_, u32>,
    biases: PyReadonlyArray2<'_, u64>,
    activation: &str,
    alpha: f32,
    limit: f32,
    threads: usize,
    int8_activations: bool,
    column_block: usize,
) -> PyResult<()> {
    let err = |m: String| PyValueError::new_err(format!("moe_experts: {m}"));
    if !gemm::available() {
        return Err(NativeError::new_err(
            "moe_experts: this CPU has neither AVX-512F nor AVX2 with FMA",
        ));
    }
    let act = Activation::parse(activation, alpha, limit)
        .ok_or_else(|| err(format!("unknown activation {activation:?}")))?;
    let dims = Dims { hidden, inner };
    let table = expert_table(&matrices, &types, &biases, dims).map_err(err)?;
    let routing = routing_of(&experts, &weights).map_err(err)?;
    let len = experts.shape()[0]
        .checked_mul(hidden)
        .filter(|&n| n <= isize::MAX as usize / 4 && x != 0 && out != 0)
        .ok_or_else(|| {
            err(format!(
                "x [{}, {hidden}]: too large or null",
                experts.shape()[0]
            ))
        })?;
    moe::check(len, len, dims, &table, &routing).map_err(err)?;
    let plan = Plan {
        threads,
        column_block,
        acts: Activations::int8_if(int8_activations),
    };
    py.detach(|| {
        // SAFETY: the caller's guarantee above (documented in the .pyi as well).
        let (x, out) = unsafe {
            (
                std::slice::from_raw_parts(x as *const f32, len),
                std::slice::from_raw_parts_mut(out as *mut f32, len),
            )
        };
        moe::forward(x, out, dims, &table, &routing, act, plan)
    });
    Ok(())
}

/// The router's choice as slices, once `weights` is shaped as `experts` and both are
/// C-contiguous.
fn routing_of<'a>(
    experts: &'a PyReadonlyArray2<'_, i64>,
    weights: &'a PyReadonlyArray2<'_, f32>,
) -> Result<Routing<'a>, String> {
    if weights.shape() != experts.shape() {
        return Err(format!(
            "weights {:?} for experts {:?}",
            weights.shape(),
            experts.shape()
        ));
    }
    let contiguous = |name: &str| format!("{name} must be C-contiguous");
    Ok(Routing {
        ids: experts.as_slice().map_err(|_| contiguous("experts"))?,
        weights: weights.as_slice().map_err(|_| contiguous("weights"))?,
        k: experts.shape()[1],
    })
}

/// The experts' matrices as slices of their sizes, once each address is non-null and each
/// type one the kernels read with whole blocks per row.
fn expert_table<'a>(
    matrices: &'a PyReadonlyArray2<'_, u64>,
    types: &PyReadonlyArray2<'_, u32>,
    biases: &PyReadonlyArray2<'_, u64>,
    dims: Dims,
) -> Result<Vec<Expert<'a>>, String> {
    let shape = matrices.shape();
    if shape.len() != 2
        || shape[1] != 3
        || shape[0] == 0
        || types.shape() != shape
        || biases.shape() != shape
    {
        return Err("matrices, types and biases must all be [experts >= 1, 3]".into());
    }
    let (m, t, b) = (matrices.as_array(), types.as_array(), biases.as_array());
    let sizes = [
        (dims.inner, dims.hidden),
        (dims.inner, dims.hidden),
        (dims.hidden, dims.inner),
    ];
    (0..shape[0])
        .map(|e| {
            let mat =
                |j: usize| -> Result<Matrix<'a>, String> {
                    let ty = weight_type_of(t[[e, j]]).map_err(|_| {
                        format!("GGML type {} is not one the CPU kernels read", t[[e, j]])
                    })?;
                    let (n, k) = sizes[j];
                    let rb = ty.row_bytes(k).filter(|_| n > 0 && m[[e, j]] != 0).ok_or_else(|| {
                    format!("expert {e} matrix {j}: {ty:?} [{n}, {k}] is not whole blocks or null")
                })?;
                    // SAFETY: the caller's guarantee (`moe_experts`): a live buffer of n rows of
                    // rb bytes, and a bias of n floats where the address is not 0.
                    let w = unsafe {
                        std::slice::from_raw_parts(m[[e, j]] as usize as *const u8, n * rb)
                    };
                    let bias = (b[[e, j]] != 0).then(|| unsafe {
                        std::slice::from_raw_parts(b[[e, j]] as usize as *const f32, n)
                    });
                    Ok(Matrix { ty, w, bias })
                };
            Ok(Expert {
                gate: mat(0)?,
                up: mat(1)?,
                down: mat(2)?,
            })
        })
        .collect()
}
