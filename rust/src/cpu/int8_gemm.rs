//! `out = x @ w^T` for GGUF block weights with x quantized to 8 bits: the opt-in integer path
//! of `engine.activations: int8`, the way llama.cpp multiplies (not its code).
//!
//! Why: `small_gemm` expands every block to its exact float32 values and multiplies in float32
//! (bit for bit the dequantized model); at one or a few rows that expansion, not the memory,
//! bounds a decode step (about 25 vector instructions per 32 weights before the 4
//! multiply-adds on AVX2). Here each row of x is quantized once per call to blocks of 32 int8
//! values with one float32 scale, and a weight block's small integers meet them in integer dot
//! products (`maddubs`, or one VNNI `dpbusd`: 32 multiply-adds per instruction).
//!
//! The result is another function than the float32 model's: x is rounded to 8 bits per block
//! (an error up to half a step, max|v| / 254, per element). It is defined exactly:
//!   x block (32 finite values v): d = max|v| / 127, q = round-half-even(v * (1 / d)), so
//!   x ~= d * q (d = 0 and q = 0 where d < 2^-126: a block of values below ~1.5e-36); a
//!   weight chunk of 32: value = dw * s_e * qw_e + mw (the format's integers qw, integer
//!   multipliers s -- Q6_K's scale per 16 elements, else 1 -- float scale dw and offset mw,
//!   0 for the symmetric formats);
//!   out[i, j] = sum over chunks, in order, of (dw * dx) * D + mw * (dx * sum(q)), with the
//!   integer dot D = sum of s_e * qw_e * q_e exact in i32, each term a fused multiply-add.
//! The tests compare it with that definition computed in float64 from the dequantizer's values.
//! Numerics as `small_gemm`: every output is the same operations in the same order whatever m,
//! the thread count and the tiling, so a row's result does not depend on which other rows
//! share the call (a verify step still reproduces a decode step bit for bit), and the two
//! copies (`tiles`: AVX2, AVX-512 VNNI) give the same bits.
//!
//! Shapes: x [m, k] float32, w n rows of `ty.row_bytes(k)` bytes, out [m, n]; k a multiple of
//! the format's block. Layout: `formats` reads the blocks, `tiles` multiplies.

use crate::cpu::quant::WeightType;
use crate::cpu::small_gemm::{self as gemm, Geometry};

#[cfg(target_arch = "x86_64")]
mod formats;
#[cfg(target_arch = "x86_64")]
mod lanes;
#[cfg(target_arch = "x86_64")]
mod tiles;

/// How a product with a GGUF block weight takes x (`engine.activations`): as float32 (exact,
/// `small_gemm`) or quantized to 8 bits (this module).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activations {
    Float32,
    Int8,
}

impl Activations {
    /// Int8 where `int8`, else Float32 (a flag across the Python boundary).
    pub fn int8_if(int8: bool) -> Self {
        if int8 {
            Self::Int8
        } else {
            Self::Float32
        }
    }
}

/// out = x @ w^T: through this module where `acts` is Int8 and it reads `ty` (block formats),
/// else `small_gemm::linear_typed` (float formats always take the exact path).
pub fn linear_as(
    acts: Activations,
    ty: WeightType,
    x: &[f32],
    w: &[u8],
    out: &mut [f32],
    mnk: (usize, usize, usize),
    threads: usize,
) {
    if acts == Activations::Int8 && supports(ty) && available() {
        linear_on(widest(), ty, x, w, out, mnk, threads)
    } else {
        gemm::linear_typed(ty, x, w, out, mnk, threads)
    }
}

/// Elements per quantized block of x (every weight format's block is a multiple of it).
pub const QK: usize = 32;

/// Whether the integer path reads `ty` (the GGUF block formats; float formats do not).
pub fn supports(ty: WeightType) -> bool {
    ty.is_quantized()
}

/// Whether this CPU runs the integer path (AVX2, FMA, F16C).
pub fn available() -> bool {
    gemm::runs(gemm::Isa::Avx2)
}

/// The copies of the integer path (`tiles`): AVX2, and AVX-512 VNNI on 256-bit registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Copy {
    Avx2,
    Vnni,
}

/// Whether this CPU runs `copy`.
pub fn runs(copy: Copy) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let vnni = std::arch::is_x86_feature_detected!("avx512vnni")
            && std::arch::is_x86_feature_detected!("avx512vl");
        available() && (copy == Copy::Avx2 || vnni)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = copy;
        false
    }
}

/// The copy `linear` runs here: VNNI where the CPU has it.
pub fn widest() -> Copy {
    if runs(Copy::Vnni) {
        Copy::Vnni
    } else {
        Copy::Avx2
    }
}

/// x [m, k] as 8-bit blocks: row r's block b is `qs[r * k + 32 b..][..32]` ~= `d[b * m + r]`
/// times it; `sums[b * m + r]` is sum(q) and `ds[..]` d * sum(q) (the terms a weight format's
/// offset meets). Scales are block-major, so a tile's rows' scales of one block are adjacent;
/// the per-block arrays hold 4 zeros more (a tile loads 4 rows' scales at once).
pub struct QuantizedRows {
    pub m: usize,
    pub k: usize,
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
    pub ds: Vec<f32>,
    pub sums: Vec<i32>,
}

/// Quantizes x [m, k] (k a multiple of `QK`) by the rule in the header. Panics on a CPU
/// without AVX2 (`available`).
pub fn quantize_rows(x: &[f32], k: usize) -> QuantizedRows {
    assert!(k > 0 && k.is_multiple_of(QK) && x.len().is_multiple_of(k));
    assert!(available(), "int8_gemm needs AVX2 with FMA and F16C");
    let (m, per_row) = (x.len() / k, k / QK);
    let mut out = QuantizedRows {
        m,
        k,
        qs: vec![0; x.len()],
        d: vec![0.0; m * per_row + 4],
        ds: vec![0.0; m * per_row + 4],
        sums: vec![0; m * per_row + 4],
    };
    for (i, (v, q)) in x
        .chunks_exact(QK)
        .zip(out.qs.chunks_exact_mut(QK))
        .enumerate()
    {
        // SAFETY: v and q hold QK values; the CPU runs AVX2 (asserted).
        #[cfg(target_arch = "x86_64")]
        let (d, sum) = unsafe { tiles::quantize_block(v.as_ptr(), q.as_mut_ptr()) };
        #[cfg(not(target_arch = "x86_64"))]
        let (d, sum) = (0.0, 0);
        let at = i % per_row * m + i / per_row; // block-major
        out.d[at] = d;
        out.ds[at] = d * sum as f32;
        out.sums[at] = sum;
    }
    out
}

/// out[i, j] = the integer-path product of x row i and weight row j (header), on `copy`
/// (`widest()` is the one to run; tests compare them), on up to `threads` threads. Panics on
/// a shape mismatch, `m > small_gemm::MAX_ROWS`, a format the path does not read
/// (`supports`) or a copy the CPU does not run (`runs`).
pub fn linear_on(
    copy: Copy,
    ty: WeightType,
    x: &[f32],
    w: &[u8],
    out: &mut [f32],
    (m, n, k): (usize, usize, usize),
    threads: usize,
) {
    assert!(runs(copy), "int8_gemm: this CPU cannot run {copy:?}");
    assert!(supports(ty), "int8_gemm does not read {ty:?}");
    let geometry = Geometry::checked("int8_gemm", ty, (x.len(), w.len(), out.len()), (m, n, k));
    let xq = quantize_rows(x, k);
    let (wp, op) = (w.as_ptr() as usize, out.as_mut_ptr() as usize);
    gemm::split_columns(n, threads, &|cols| {
        // SAFETY: w and out outlive the call; parts write disjoint output columns of every
        // row; the shapes were asserted and the CPU runs `copy` (asserted).
        unsafe {
            columns_on(
                copy,
                ty,
                &xq,
                wp as *const u8,
                op as *mut f32,
                &geometry,
                cols,
            )
        }
    });
}

/// Output columns `cols` of the integer-path product of the quantized rows `xq` with w (every
/// row), on the calling thread with the widest copy: the part of a call each thread computes,
/// for callers that split the work themselves (`moe`).
///
/// # Safety
/// xq quantizes x [m, k] of `g`, w holds n rows of `g.row_bytes`, out [m, n], cols lies in
/// 0..n, no other thread writes those columns meanwhile, `supports(ty)` and `available()`.
pub(crate) unsafe fn columns(
    ty: WeightType,
    xq: &QuantizedRows,
    w: *const u8,
    out: *mut f32,
    g: &Geometry,
    cols: std::ops::Range<usize>,
) {
    columns_on(widest(), ty, xq, w, out, g, cols)
}

/// `columns` on one copy (the CPU runs it).
unsafe fn columns_on(
    copy: Copy,
    ty: WeightType,
    xq: &QuantizedRows,
    w: *const u8,
    out: *mut f32,
    g: &Geometry,
    cols: std::ops::Range<usize>,
) {
    #[cfg(target_arch = "x86_64")]
    match copy {
        Copy::Avx2 => tiles::avx2::columns(ty, xq, w, out, g, cols),
        Copy::Vnni => tiles::vnni::columns(ty, xq, w, out, g, cols),
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (copy, ty, xq, w, out, g, cols);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::quant::{dequantize_row, ALL};
    use crate::testutil::{random_blocks, values};

    /// The header's definition in float64 from the dequantizer's values: sum of w * (dx * q).
    fn reference(
        ty: WeightType,
        x: &[f32],
        w: &[u8],
        (m, n, k): (usize, usize, usize),
    ) -> Vec<(f64, f64)> {
        let xq = quantize_rows(x, k);
        let rb = ty.row_bytes(k).unwrap();
        let mut wide = vec![0f32; k];
        let mut out = vec![(0.0, 0.0); m * n];
        for j in 0..n {
            dequantize_row(ty, &w[j * rb..][..rb], &mut wide);
            for i in 0..m {
                let (mut sum, mut size) = (0f64, 0f64);
                for (t, &wt) in wide.iter().enumerate() {
                    let xv = xq.d[t / QK * m + i] as f64 * xq.qs[i * k + t] as f64;
                    sum += wt as f64 * xv;
                    size += (wt as f64 * xv).abs();
                }
                out[i * n + j] = (sum, size);
            }
        }
        out
    }

    #[test]
    fn rows_quantize_to_round_half_even_of_v_over_max_by_127() {
        let mut x = vec![0f32; 64];
        x[0] = 1.27;
        x[1] = -0.635; // -63.5 -> -64 (half to even)
        x[2] = 0.025; // 2.5 -> 2
        x[3] = -1.27;
        let q = quantize_rows(&x, 32);
        assert_eq!(&q.qs[..4], &[127, -64, 2, -127]);
        assert!((q.d[0] - 0.01).abs() < 1e-8);
        assert_eq!((q.d[1], q.ds[1]), (0.0, 0.0)); // an all-zero block
        assert_eq!(q.d.len(), 2 + 4);
        assert!((q.ds[0] - 0.01 * (127 - 64 + 2 - 127) as f32).abs() < 1e-6);
    }

    #[test]
    fn rows_quantize_as_a_scalar_statement_of_the_rule() {
        if !available() {
            return;
        }
        let k = 128;
        let mut x = values(3 * k, 9);
        x[5] *= 300.0; // an outlier
        x[40..64].iter_mut().for_each(|v| *v = 0.0); // a block half zero
        x[64..96].iter_mut().for_each(|v| *v *= 1e-37); // d below 2^-126: zeros
        let q = quantize_rows(&x, k);
        for (b, v) in x.chunks_exact(QK).enumerate() {
            let amax = v.iter().fold(0f32, |a, &e| a.max(e.abs()));
            let d = amax / 127.0;
            let id = if d >= f32::MIN_POSITIVE { 1.0 / d } else { 0.0 };
            let want: Vec<i8> = v.iter().map(|e| (e * id).round_ties_even() as i8).collect();
            let (row, blk) = (b / (k / QK), b % (k / QK));
            assert_eq!(&q.qs[b * QK..][..QK], &want[..], "block {b}");
            let at = blk * 3 + row;
            let sum: i32 = want.iter().map(|&e| e as i32).sum();
            assert_eq!((q.d[at], q.sums[at]), (if id > 0.0 { d } else { 0.0 }, sum));
        }
    }

    #[test]
    fn every_format_matches_its_definition_and_rows_do_not_depend_on_each_other() {
        if !available() {
            return;
        }
        for ty in ALL.into_iter().filter(|t| supports(*t)) {
            let (n, k) = (37, 2 * ty.block().0.max(256));
            let w = random_blocks(ty, n, k, 5 + ty.ggml_id() as u64);
            let m = 9;
            let x = values(m * k, 3);
            let expect = reference(ty, &x, &w, (m, n, k));
            let mut out = vec![0f32; m * n];
            linear_on(Copy::Avx2, ty, &x, &w, &mut out, (m, n, k), 3);
            for (o, (sum, size)) in out.iter().zip(&expect) {
                let tol = 1e-5 * size + 1e-30;
                assert!(
                    (*o as f64 - sum).abs() <= tol,
                    "{ty:?}: {o} vs {sum} (size {size})"
                );
            }
            // the VNNI copy forms the same integer dots: the same bits
            if runs(Copy::Vnni) {
                let mut vnni = vec![0f32; m * n];
                linear_on(Copy::Vnni, ty, &x, &w, &mut vnni, (m, n, k), 2);
                let same = vnni
                    .iter()
                    .zip(&out)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{ty:?}: VNNI differs from AVX2");
            }
            // each row alone gives the same bits as in the 9-row call
            for i in [0, 4, 8] {
                let mut one = vec![0f32; n];
                linear_on(widest(), ty, &x[i * k..][..k], &w, &mut one, (1, n, k), 1);
                let same = one
                    .iter()
                    .zip(&out[i * n..])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{ty:?} row {i}");
            }
        }
    }

    #[test]
    fn the_error_against_float32_activations_stays_within_half_a_step_per_element() {
        if !available() {
            return;
        }
        let ty = WeightType::Q4_0;
        let (m, n, k) = (2, 16, 512);
        let w = random_blocks(ty, n, k, 1);
        let x = values(m * k, 2);
        let mut out = vec![0f32; m * n];
        linear_on(widest(), ty, &x, &w, &mut out, (m, n, k), 1);
        let xq = quantize_rows(&x, k);
        let mut wide = vec![0f32; k];
        let rb = ty.row_bytes(k).unwrap();
        for j in 0..n {
            dequantize_row(ty, &w[j * rb..][..rb], &mut wide);
            for i in 0..m {
                let exact: f64 = (0..k).map(|t| wide[t] as f64 * x[i * k + t] as f64).sum();
                let bound: f64 = (0..k)
                    .map(|t| wide[t].abs() as f64 * xq.d[t / QK * m + i] as f64 / 2.0)
                    .sum();
                let err = (out[i * n + j] as f64 - exact).abs();
                assert!(err <= bound * 1.001 + 1e-6, "{err} > {bound}");
            }
        }
    }

    /// `cargo test --release int8_speed -- --ignored --nocapture`: one thread, 8192 x 2048.
    #[test]
    #[ignore]
    fn int8_speed() {
        use std::time::Instant;
        let (n, k) = (8192, 2048);
        for ty in [
            WeightType::Q4_0,
            WeightType::Q8_0,
            WeightType::Q4K,
            WeightType::Q6K,
        ] {
            let w = random_blocks(ty, n, k, 7);
            for m in [1, 4, 16, 64] {
                let x = values(m * k, 1);
                let mut out = vec![0f32; m * n];
                let time = |f: &mut dyn FnMut()| {
                    f();
                    let s = Instant::now();
                    for _ in 0..5 {
                        f();
                    }
                    s.elapsed().as_secs_f64() / 5.0
                };
                let a = time(&mut || gemm::linear_typed(ty, &x, &w, &mut out, (m, n, k), 1));
                let b = time(&mut || linear_on(Copy::Avx2, ty, &x, &w, &mut out, (m, n, k), 1));
                let c = if runs(Copy::Vnni) {
                    time(&mut || linear_on(Copy::Vnni, ty, &x, &w, &mut out, (m, n, k), 1))
                } else {
                    f64::NAN
                };
                let g = (m * n * k) as f64 / 1e9;
                println!(
                    "{ty:?} m={m}: float {:.1}, int8 AVX2 {:.1}, int8 VNNI {:.1} Gmac/s",
                    g / a,
                    g / b,
                    g / c
                );
            }
        }
    }
}
