//! Whole Llama-style decoder layers in float32 for the few query rows of a CPU decode or verify
//! step: RMSNorm, q/k/v, RoPE, the KV-cache write, paged attention, o, residual, RMSNorm,
//! SwiGLU MLP, residual, in one call per run of layers.
//!
//! Why native: at batch 1 the GEMMs of a layer take ~0.5 ms and torch's dispatch of the ~25
//! small ops around them (norms, rotary, views, casts, cache writes) ~0.1 ms more, per layer,
//! for plain decoding and every verify and draft step alike. On the GPU CUDA graphs remove that
//! cost; on the CPU this is the equivalent: the same math on the same kernels (`small_gemm`,
//! `paged_attention`), with the elementwise parts here.
//!
//! Shapes (T query rows, H hidden, Hq / Hkv heads of D, I intermediate):
//!   x      [T, H]   the residual stream, updated in place (layer input -> layer output)
//!   input  [T, in]  optional: the first layer's normed attention input given by the caller
//!                   (EAGLE draft layers build theirs from two inputs); else RMSNorm(x)
//!   q/k/v/o, gate/up/down: [n, k] row-major weights (float32, bfloat16 bits or GGUF blocks),
//!                   optional bias
//!   cos/sin [max_positions, D] RoPE tables ("rotate half": halves are real and imaginary)
//!   kv_cache per layer [2, num_blocks, block_size, Hkv, D]; row t's K/V go to slot_mapping[t]
//! Numerics: every operation works on one row at a time in a fixed order (the GEMM and the
//! attention kernel guarantee the same), so a row's output does not depend on the other rows
//! of the call: a verify step reproduces a decode step bit for bit. RoPE computes x * cos +
//! rotated * sin with separate roundings, as torch does.

use crate::cpu::int8_gemm::{self, Activations};
use crate::cpu::paged_attention as attn;
use crate::cpu::quant::WeightType;
use crate::cpu::small_gemm as gemm;

/// A weight matrix [n, k], row-major: n rows of `ty.row_bytes(k)` bytes (float32, bfloat16
/// bits or GGUF blocks, `quant`), read by `small_gemm::linear_typed`, or for block formats
/// with `acts` Int8 by `int8_gemm`.
#[derive(Clone, Copy)]
pub struct Weight<'a> {
    pub ty: WeightType,
    pub bytes: &'a [u8],
    pub acts: Activations,
}

/// out = x @ w^T + bias for one projection.
#[derive(Clone, Copy)]
pub struct Proj<'a> {
    pub weight: Weight<'a>,
    pub bias: Option<&'a [f32]>,
    /// Output features (rows of the weight).
    pub n: usize,
    /// Input features.
    pub k: usize,
}

/// One layer's parameters and KV cache.
pub struct Layer<'a> {
    /// RMSNorm weight [H] before attention; None: the layer takes its input from the caller.
    pub input_norm: Option<&'a [f32]>,
    pub q: Proj<'a>,
    pub k: Proj<'a>,
    pub v: Proj<'a>,
    pub o: Proj<'a>,
    /// RMSNorm weights [D] over each query / key head before RoPE (Qwen3); None: no norm.
    pub q_norm: Option<&'a [f32]>,
    pub k_norm: Option<&'a [f32]>,
    pub post_norm: &'a [f32],
    pub gate: Proj<'a>,
    pub up: Proj<'a>,
    pub down: Proj<'a>,
    pub kv_cache: &'a mut [f32],
}

/// The sizes shared by all layers of a call.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub hidden: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub eps: f32,
    pub scale: f32,
    pub block_size: usize,
    pub num_blocks: usize,
}

/// The rows of a step: positions (RoPE), cache slots, and the attention step over them.
pub struct Rows<'a> {
    pub positions: &'a [i64],
    pub slot_mapping: &'a [i64],
    pub step: attn::Step<'a>,
    /// Columns of `step.block_tables`.
    pub max_blocks: usize,
    pub cos: &'a [f32],
    pub sin: &'a [f32],
}

/// Runs `layers` in order over x [T, H] (in place). `input` [T, in]: the first layer's
/// attention input instead of RMSNorm(x). `threads`: GEMM and attention threads. Errors on
/// inconsistent shapes or indices before anything is written.
pub fn forward(
    layers: &mut [Layer],
    shape: &Shape,
    rows: &Rows,
    x: &mut [f32],
    input: Option<&[f32]>,
    threads: usize,
) -> Result<(), String> {
    let t = rows.positions.len();
    check(layers, shape, rows, x, input, t)?;
    let layout = attn::Layout {
        num_heads: shape.num_heads,
        num_kv_heads: shape.num_kv_heads,
        head_dim: shape.head_dim,
        block_size: shape.block_size,
        num_blocks: shape.num_blocks,
        max_blocks: rows.max_blocks,
    };
    attn::check(&layout, &rows.step, t)?; // the block tables too, before any cache write
    let inner = layers.first().map_or(0, |l| l.gate.n);
    let mut buf = Scratch::new(shape, t, inner);
    let run = Run {
        s: shape,
        rows,
        layout: &layout,
        t,
        threads,
    };
    for (i, layer) in layers.iter_mut().enumerate() {
        let given = input.filter(|_| i == 0);
        run.attention(layer, given, x, &mut buf)?;
        run.mlp(layer, x, &mut buf);
    }
    Ok(())
}

/// The per-call work buffers, allocated once and reused by every layer; each holds T rows
/// (`normed`, `o` of H values, `q`, `attn_out` of Hq * D, `k`, `v` of Hkv * D, `gate`, `up`
/// of I).
struct Scratch {
    normed: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn_out: Vec<f32>,
    o: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    /// a copy of q or k while their heads are normed (Qwen3)
    heads: Vec<f32>,
}

impl Scratch {
    fn new(s: &Shape, t: usize, inner: usize) -> Self {
        let (q_size, kv_size) = (s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim);
        Scratch {
            normed: vec![0f32; t * s.hidden],
            q: vec![0f32; t * q_size],
            k: vec![0f32; t * kv_size],
            v: vec![0f32; t * kv_size],
            attn_out: vec![0f32; t * q_size],
            o: vec![0f32; t * s.hidden],
            gate: vec![0f32; t * inner],
            up: vec![0f32; t * inner],
            heads: Vec::new(),
        }
    }
}

/// What every layer of one `forward` call shares (all checked by `check` and `attn::check`).
struct Run<'r, 'a> {
    s: &'r Shape,
    rows: &'r Rows<'a>,
    layout: &'r attn::Layout,
    t: usize,
    threads: usize,
}

impl Run<'_, '_> {
    /// x += o(attention(rope(q), rope(k), v)) over `given` or RMSNorm(x); writes the rows'
    /// K/V into the layer's cache before attending, so a row sees itself and earlier rows.
    fn attention(
        &self,
        layer: &mut Layer,
        given: Option<&[f32]>,
        x: &mut [f32],
        buf: &mut Scratch,
    ) -> Result<(), String> {
        let (s, t, threads) = (self.s, self.t, self.threads);
        let a: &[f32] = match given {
            Some(given) => given,
            None => {
                // `check`: a layer without an input norm is given its input
                rms_norm(
                    x,
                    layer.input_norm.unwrap_or_default(),
                    s.eps,
                    &mut buf.normed,
                );
                &buf.normed
            }
        };
        project(&layer.q, a, t, &mut buf.q, threads);
        project(&layer.k, a, t, &mut buf.k, threads);
        project(&layer.v, a, t, &mut buf.v, threads);
        norm_heads(&mut buf.q, layer.q_norm, s.eps, &mut buf.heads);
        norm_heads(&mut buf.k, layer.k_norm, s.eps, &mut buf.heads);
        rotate(&mut buf.q, s.num_heads, s.head_dim, self.rows);
        rotate(&mut buf.k, s.num_kv_heads, s.head_dim, self.rows);
        self.write_kv(layer.kv_cache, &buf.k, &buf.v);
        attn::attend(
            &buf.q,
            layer.kv_cache,
            &mut buf.attn_out,
            self.layout,
            &self.rows.step,
            s.scale,
            threads,
        )?;
        project(&layer.o, &buf.attn_out, t, &mut buf.o, threads);
        x.iter_mut().zip(&buf.o).for_each(|(h, d)| *h += d);
        Ok(())
    }

    /// Copies row r's K and V ([Hkv * D] each) to slot `slot_mapping[r]` of the K plane and
    /// the V plane of `kv_cache` [2, num_blocks * block_size, Hkv * D].
    fn write_kv(&self, kv_cache: &mut [f32], k: &[f32], v: &[f32]) {
        let s = self.s;
        let kv_size = s.num_kv_heads * s.head_dim;
        let plane = s.num_blocks * s.block_size * kv_size; // K, then V
        for (r, &slot) in self.rows.slot_mapping.iter().enumerate() {
            let at = slot as usize * kv_size;
            kv_cache[at..at + kv_size].copy_from_slice(&k[r * kv_size..][..kv_size]);
            kv_cache[plane + at..plane + at + kv_size]
                .copy_from_slice(&v[r * kv_size..][..kv_size]);
        }
    }

    /// x += down(silu(gate(n)) * up(n)), n = RMSNorm(x) with the post-attention norm.
    fn mlp(&self, layer: &Layer, x: &mut [f32], buf: &mut Scratch) {
        let (s, t, threads) = (self.s, self.t, self.threads);
        rms_norm(x, layer.post_norm, s.eps, &mut buf.normed);
        project(&layer.gate, &buf.normed, t, &mut buf.gate, threads);
        project(&layer.up, &buf.normed, t, &mut buf.up, threads);
        silu_mul(&mut buf.gate, &buf.up, layer.gate.n);
        project(&layer.down, &buf.gate, t, &mut buf.o, threads);
        x.iter_mut().zip(&buf.o).for_each(|(h, d)| *h += d);
    }
}

/// Checks every shape and index `forward` relies on, before anything is written: the rows
/// (`check_rows`), then each layer in order (`check_layer`); the first failure is the error.
fn check(
    layers: &[Layer],
    s: &Shape,
    rows: &Rows,
    x: &[f32],
    input: Option<&[f32]>,
    t: usize,
) -> Result<(), String> {
    check_rows(s, rows, x, t)?;
    for (i, l) in layers.iter().enumerate() {
        let in_features = match input {
            Some(given) if i == 0 => {
                if given.len() % t != 0 {
                    return Err(format!("input holds {} values for {t} rows", given.len()));
                }
                given.len() / t
            }
            _ => s.hidden,
        };
        let given = i == 0 && input.is_some();
        check_layer(i, l, s, layers[0].gate.n, in_features, given)?;
    }
    Ok(())
}

/// 1..=MAX_ROWS rows with x [T, H] and slot_mapping [T]; an even head_dim and RoPE tables
/// [P, D]; every position in 0..P and every slot in the cache.
fn check_rows(s: &Shape, rows: &Rows, x: &[f32], t: usize) -> Result<(), String> {
    let (h, d) = (s.hidden, s.head_dim);
    if !(1..=gemm::MAX_ROWS).contains(&t) || x.len() != t * h || rows.slot_mapping.len() != t {
        return Err(format!(
            "{t} rows (1..={}) need x [{t}, {h}] and slot_mapping [{t}]",
            gemm::MAX_ROWS
        ));
    }
    if d == 0
        || !d.is_multiple_of(2)
        || rows.cos.len() != rows.sin.len()
        || !rows.cos.len().is_multiple_of(d)
    {
        return Err(format!(
            "head_dim {d} must be even and the RoPE tables [P, {d}]"
        ));
    }
    let max_positions = (rows.cos.len() / d) as i64;
    if let Some(p) = rows
        .positions
        .iter()
        .find(|&&p| p < 0 || p >= max_positions)
    {
        return Err(format!(
            "position {p} outside the RoPE table's {max_positions}"
        ));
    }
    let slots = (s.num_blocks * s.block_size) as i64;
    if let Some(slot) = rows.slot_mapping.iter().find(|&&v| v < 0 || v >= slots) {
        return Err(format!("slot {slot} outside the cache's {slots} slots"));
    }
    Ok(())
}

/// Layer `i`: every projection [n, k] with n * k weights and an n-value bias if any (q/k/v
/// take `in_features`, the MLP is `inner` wide, as layer 0's); norm weights of H values (no
/// input norm needed when the input is `given`); a KV cache of the full size.
fn check_layer(
    i: usize,
    l: &Layer,
    s: &Shape,
    inner: usize,
    in_features: usize,
    given: bool,
) -> Result<(), String> {
    let h = s.hidden;
    let (q_size, kv_size) = (s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim);
    let shapes = [
        (&l.q, q_size, in_features),
        (&l.k, kv_size, in_features),
        (&l.v, kv_size, in_features),
        (&l.o, h, q_size),
        (&l.gate, inner, h),
        (&l.up, inner, h),
        (&l.down, h, inner),
    ];
    for (p, n, k) in shapes {
        let (ty, len) = (p.weight.ty, p.weight.bytes.len());
        let fits = ty.row_bytes(k).is_some_and(|r| len == n * r);
        if p.n != n || p.k != k || !fits || p.bias.is_some_and(|b| b.len() != n) {
            return Err(format!(
                "layer {i}: a projection is [{}, {}] ({len} bytes of {ty:?}), expected [{n}, {k}]",
                p.n, p.k
            ));
        }
    }
    if !given && l.input_norm.is_none_or(|w| w.len() != h) || l.post_norm.len() != h {
        return Err(format!(
            "layer {i}: norm weights must have {h} values (the input norm, or an input)"
        ));
    }
    if [l.q_norm, l.k_norm]
        .iter()
        .any(|n| n.is_some_and(|w| w.len() != s.head_dim))
    {
        return Err(format!(
            "layer {i}: q/k norm weights must have head_dim = {} values",
            s.head_dim
        ));
    }
    if l.kv_cache.len() != 2 * s.num_blocks * s.block_size * kv_size {
        return Err(format!("layer {i}: KV cache size {}", l.kv_cache.len()));
    }
    Ok(())
}

fn project(p: &Proj, x: &[f32], m: usize, out: &mut [f32], threads: usize) {
    let out = &mut out[..m * p.n];
    let w = p.weight;
    int8_gemm::linear_as(w.acts, w.ty, x, w.bytes, out, (m, p.n, p.k), threads);
    if let Some(bias) = p.bias {
        for row in out.chunks_exact_mut(p.n) {
            row.iter_mut().zip(bias).for_each(|(o, b)| *o += b);
        }
    }
}

/// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, per row of `weight.len()` values.
pub(crate) fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let h = weight.len();
    for (row, dst) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
        let inv = 1.0 / (sum_of_squares(row, |v| v) / h as f32 + eps).sqrt();
        dst.iter_mut()
            .zip(row.iter().zip(weight))
            .for_each(|(o, (v, w))| *o = v * inv * w);
    }
}

/// The sum of value(v)^2 over `row`: 16 partial sums in a fixed order (vectorises), then a
/// fixed reduction, so a row's sum never depends on where it sits (the RMSNorms' mean).
#[inline(always)]
pub(crate) fn sum_of_squares<T: Copy>(row: &[T], value: impl Fn(T) -> f32) -> f32 {
    const LANES: usize = 16;
    let mut part = [0f32; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        part.iter_mut()
            .zip(c)
            .for_each(|(p, &v)| *p += value(v) * value(v));
    }
    part.iter_mut()
        .zip(chunks.remainder())
        .for_each(|(p, &v)| *p += value(v) * value(v));
    part.iter().sum()
}

/// RMSNorm over each head (rows of D = weight.len() values) of x, in place; nothing without
/// a weight.
fn norm_heads(x: &mut [f32], weight: Option<&[f32]>, eps: f32, copy: &mut Vec<f32>) {
    if let Some(w) = weight {
        copy.clear();
        copy.extend_from_slice(x);
        rms_norm(copy, w, eps, x);
    }
}

/// RoPE ("rotate half") of every head of every row at the row's position, in place:
/// out = x * cos + [-x2, x1] * sin over the two halves x1, x2 of a head.
fn rotate(x: &mut [f32], heads: usize, d: usize, rows: &Rows) {
    let half = d / 2;
    for (r, &pos) in rows.positions.iter().enumerate() {
        let cos = &rows.cos[pos as usize * d..][..d];
        let sin = &rows.sin[pos as usize * d..][..d];
        for head in x[r * heads * d..][..heads * d].chunks_exact_mut(d) {
            let mut rotated = [0f32; attn::MAX_HEAD_DIM];
            for i in 0..half {
                rotated[i] = -head[i + half];
                rotated[i + half] = head[i];
            }
            for i in 0..d {
                head[i] = head[i] * cos[i] + rotated[i] * sin[i];
            }
        }
    }
}

/// gate = silu(gate) * up, row by row (`inner` values each): 16 lanes at a time with AVX-512,
/// the scalar code compiled for AVX2 (vectorised by the compiler) where the CPU has that, the
/// same operations per element as `silu` in every case.
pub(crate) fn silu_mul(gate: &mut [f32], up: &[f32], inner: usize) {
    for (g, u) in gate.chunks_exact_mut(inner).zip(up.chunks_exact(inner)) {
        #[allow(unused_mut)]
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        match gemm::isa() {
            // SAFETY: the CPU runs the instruction set (detected); both slices hold `inner`
            // values.
            Some(gemm::Isa::Avx512) => done = unsafe { avx512::silu_mul(g, u) },
            Some(gemm::Isa::Avx2) => done = unsafe { silu_mul_avx2(g, u) },
            None => {}
        }
        silu_mul_scalar(&mut g[done..], &u[done..]);
    }
}

#[inline(always)]
fn silu_mul_scalar(g: &mut [f32], u: &[f32]) -> usize {
    for (g, u) in g.iter_mut().zip(u) {
        *g = silu(*g) * u;
    }
    g.len()
}

/// `silu_mul_scalar` compiled for AVX2 (Rust never fuses a multiply and an add on its own, so
/// the vectorised loop rounds as the scalar one).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(g: &mut [f32], u: &[f32]) -> usize {
    silu_mul_scalar(g, u)
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use crate::cpu::paged_attention::avx512::exp16;
    use std::arch::x86_64::*;

    /// `silu` on 16 lanes, operation for operation.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn silu16(x: __m512) -> __m512 {
        let one = _mm512_set1_ps(1.0);
        let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
        let denom = _mm512_add_ps(one, e);
        let nonneg = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_setzero_ps());
        // one division: (x >= 0 ? 1 : e) / (1 + e), each lane's the scalar code's quotient
        let sigmoid = _mm512_div_ps(_mm512_mask_mov_ps(e, nonneg, one), denom);
        _mm512_mul_ps(x, sigmoid)
    }

    /// `silu(g) * u` over the first multiple of 16 values, operation for operation as the
    /// scalar code; returns how many values it did.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn silu_mul(g: &mut [f32], u: &[f32]) -> usize {
        let n = g.len().min(u.len()) / 16 * 16;
        for i in (0..n).step_by(16) {
            let x = _mm512_loadu_ps(g.as_ptr().add(i));
            let out = _mm512_mul_ps(silu16(x), _mm512_loadu_ps(u.as_ptr().add(i)));
            _mm512_storeu_ps(g.as_mut_ptr().add(i), out);
        }
        n
    }
}

/// x * sigmoid(x) through `exp_nonpositive` (e^-|x| never overflows).
#[inline(always)]
pub(crate) fn silu(x: f32) -> f32 {
    let e = attn::exp_nonpositive(-x.abs());
    let sigmoid = if x >= 0.0 {
        1.0 / (1.0 + e)
    } else {
        e / (1.0 + e)
    };
    x * sigmoid
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::values;

    #[test]
    fn silu_mul_lanes_equal_the_scalar_code() {
        let inner = 37; // two 16-lane steps and a scalar tail per row
        let g: Vec<f32> = values(2 * inner, 3).iter().map(|v| v * 40.0).collect();
        let u = values(2 * inner, 4);
        let mut got = g.clone();
        silu_mul(&mut got, &u, inner);
        for i in 0..2 * inner {
            assert_eq!(got[i].to_bits(), (silu(g[i]) * u[i]).to_bits(), "{i}");
        }
        #[cfg(target_arch = "x86_64")]
        if gemm::runs(gemm::Isa::Avx2) {
            let mut avx2 = g.clone();
            // SAFETY: the CPU has AVX2 and FMA (checked).
            unsafe { silu_mul_avx2(&mut avx2, &u) };
            assert_eq!(avx2, got);
        }
    }

    #[test]
    fn silu_and_rms_norm_match_float64() {
        for x in [-100.0f32, -20.0, -3.5, -0.1, 0.0, 0.2, 4.0, 30.0, 90.0] {
            let want = x as f64 / (1.0 + (-(x as f64)).exp());
            assert!(
                (silu(x) as f64 - want).abs() <= 1e-6 * want.abs().max(1e-30),
                "{x}"
            );
        }
        let (x, w) = (values(2 * 37, 1), values(37, 2));
        let mut out = vec![0.0; 2 * 37];
        rms_norm(&x, &w, 1e-5, &mut out);
        for r in 0..2 {
            let row = &x[r * 37..][..37];
            let ms = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / 37.0;
            for i in 0..37 {
                let want = row[i] as f64 / (ms + 1e-5).sqrt() * w[i] as f64;
                assert!((out[r * 37 + i] as f64 - want).abs() < 1e-5, "{r} {i}");
            }
        }
    }
}
