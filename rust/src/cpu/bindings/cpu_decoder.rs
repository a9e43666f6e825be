//! `CpuDecoder`: a model's decoder layers for the few-row CPU path, run by `decoder_layer`.

use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::weight_type_of;
use crate::cpu::decoder_layer as layers;
use crate::cpu::int8_gemm::Activations;
use crate::cpu::paged_attention as attn;
use crate::cpu::quant::WeightType;
use crate::cpu::small_gemm as gemm;

/// Addresses of one decoder layer's tensors, in this order: input_norm (0: none, the layer
/// is given its input), q, k, v, o, post_norm, gate, up, down weights, then the biases of q,
/// k, v, o, gate, up, down (0: none), then the per-head q and k norm weights [D] (0: none).
const LAYER_TENSORS: usize = 18;

/// A model's decoder layers for the few-row CPU path (`decoder_layer`), held as raw addresses
/// (tensor.data_ptr()) so that a step pays no conversion per tensor. The caller
/// (`cpu/decoder.py`, the only one) keeps every tensor alive and unchanged while this
/// object exists, all float32 but the weights, whose format is given per projection in
/// `weight_types` (GGML type numbers: float32, bfloat16 bits or GGUF blocks, n rows of
/// `row_bytes(k)` bytes), C-contiguous and of the documented shapes; the RoPE tables are
/// [max_positions, head_dim].
#[pyclass(frozen)]
pub(super) struct CpuDecoder {
    layers: Vec<[usize; LAYER_TENSORS]>,
    weight_types: Vec<[WeightType; 7]>,
    /// How the block-format projections take x (`int8_gemm`).
    acts: Activations,
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
    #[pyo3(signature = (layers, weight_types, in_features, hidden, intermediate, num_heads,
                        num_kv_heads, head_dim, eps, scale, cos, sin, max_positions,
                        int8_activations = false))]
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
        int8_activations: bool,
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
        let table = address_table(&layers).map_err(|e| bad(&e))?;
        let types = weight_types
            .iter()
            .map(|ids| layer_weight_types(ids))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(Self {
            layers: table,
            weight_types: types,
            acts: Activations::int8_if(int8_activations),
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
                    let proj =
                        |j: usize, n: usize, k: usize| projection(a, (ty, self.acts), j, n, k);
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

/// Each layer's addresses as an array, checked: LAYER_TENSORS of them, no null weight.
fn address_table(layers: &[Vec<usize>]) -> Result<Vec<[usize; LAYER_TENSORS]>, String> {
    let mut table = Vec::with_capacity(layers.len());
    for (i, l) in layers.iter().enumerate() {
        let addrs: [usize; LAYER_TENSORS] = l
            .as_slice()
            .try_into()
            .map_err(|_| format!("layer {i}: {LAYER_TENSORS} addresses expected"))?;
        if addrs[1..9].contains(&0) {
            return Err(format!("layer {i}: null weight"));
        }
        table.push(addrs);
    }
    Ok(table)
}

/// Projection `j` (q, k, v, o, gate, up, down) of a layer's addresses `a`: its weight [n, k]
/// (of format `ty[j]`) and bias [n] (address 0: none).
///
/// # Safety
/// The addresses are live tensors of those sizes.
unsafe fn projection<'a>(
    a: [usize; LAYER_TENSORS],
    (ty, acts): ([WeightType; 7], Activations),
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
                acts,
            },
            bias: (b != 0).then(|| f32_slice(b, n)),
            n,
            k,
        }
    }
}
