//! `out = x @ w^T` in float32 for the rows of a CPU decode or verify step (up to `MAX_ROWS`).
//!
//! The one piece of tensor math on the Rust side, and why: at batch 1 a plain decode step
//! multiplies 1 row and a K = 3 verify step 4 rows by every weight matrix. The work is memory
//! bound (each weight is read once per step), but MKL, which `F.linear` calls, changes strategy
//! at 4 rows and takes ~1.9x the 1-row time (benchmarks/cpu_small_gemm.py), and on CPUs without
//! AVX-512 reads a 1-row step's weights at a fraction of the memory bandwidth. This kernel reads
//! each weight row once for all rows of `x` (up to `MAX_ROWS`), so 4 rows cost ~1.1x one, and
//! the extension is the only native code a CPU user has (PyTorch cannot build kernels without
//! a compiler at run time).
//!
//! Two copies: AVX-512F (16 lanes) and AVX2 with FMA (8 lanes); the widest the CPU runs is used.
//! Shapes: x [m, k], w [n, k] (a torch Linear weight, row-major), out [m, n], all contiguous.
//! Numerics: every output is the same sum in the same order whatever m, the thread count and
//! the row blocking (lanes over k in fixed steps, fused multiply-add, then one fixed lane
//! reduction), so a row's result does not depend on which other rows share the call: a verify
//! step computes bit for bit what a 1-row decode step would for the same inputs. The two copies
//! sum in different orders: results agree to rounding, not bit for bit, across CPUs.

use crate::omp;

/// Rows of `x` one call takes; callers use `F.linear` above it. Measured over SmolLM2-135M's
/// 210 layer matrices, 2 threads, against MKL: 16 rows 26 vs 47 ms, 64 rows 77 vs 98 ms,
/// 128 rows 156 vs 166-170 ms, 256 rows 336-343 vs 301 ms (MKL's blocked GEMM wins there).
pub const MAX_ROWS: usize = 128;

/// An instruction set the kernel has a copy for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Avx512,
    Avx2,
}

/// Whether this CPU runs the `isa` copy.
pub fn runs(isa: Isa) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        match isa {
            Isa::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = isa;
        false
    }
}

/// The widest copy this CPU runs (x86-64 with AVX-512F, else AVX2 and FMA), None without.
pub fn isa() -> Option<Isa> {
    [Isa::Avx512, Isa::Avx2].into_iter().find(|&i| runs(i))
}

/// Every copy this CPU runs, widest first (for tests that compare them).
pub fn supported() -> Vec<Isa> {
    [Isa::Avx512, Isa::Avx2]
        .into_iter()
        .filter(|&i| runs(i))
        .collect()
}

/// True when this CPU can run the kernel (see `isa`).
pub fn available() -> bool {
    isa().is_some()
}

/// out[i, j] = sum_t x[i, t] * w[j, t] on up to `threads` threads of libgomp's team (`omp`).
/// Panics on a shape mismatch, `m > MAX_ROWS` or a CPU the kernel cannot run on (`available`).
pub fn linear(x: &[f32], w: &[f32], out: &mut [f32], m: usize, n: usize, k: usize, threads: usize) {
    run::<f32>(widest(), x, w, out, (m, n, k), threads)
}

/// `linear` with bfloat16 weights (raw u16 bits) widened to float32 as they are loaded. The
/// widening is exact, so the result is bit for bit `linear` of the float32 copy of `w`, from
/// half the bytes: for weights that are bfloat16 originals (e.g. a draft head shipped in bf16).
pub fn linear_bf16_weights(
    x: &[f32],
    w: &[u16],
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    threads: usize,
) {
    run::<u16>(widest(), x, w, out, (m, n, k), threads)
}

fn widest() -> Isa {
    isa().expect("small_gemm needs AVX-512F or AVX2 with FMA")
}

fn run<W: Weight>(
    isa: Isa,
    x: &[f32],
    w: &[W],
    out: &mut [f32],
    (m, n, k): (usize, usize, usize),
    threads: usize,
) {
    assert!(runs(isa), "small_gemm: this CPU cannot run {isa:?}");
    assert!(
        (1..=MAX_ROWS).contains(&m),
        "small_gemm takes 1..={MAX_ROWS} rows, got {m}"
    );
    assert!(
        k > 0 && x.len() == m * k && w.len() == n * k && out.len() == m * n,
        "shape mismatch"
    );
    // Threads split the weight rows in multiples of BLOCK; small matrices stay on fewer threads
    // so each part keeps >= MIN_PART_ROWS rows (handing out a part costs ~1 µs).
    const MIN_PART_ROWS: usize = 64;
    let parts = threads.clamp(1, (n / MIN_PART_ROWS).max(1));
    let per_part = n.div_ceil(parts).div_ceil(BLOCK) * BLOCK;
    let (xp, wp, op) = (
        x.as_ptr() as usize,
        w.as_ptr() as usize,
        out.as_mut_ptr() as usize,
    );
    omp::run(parts, &|part| {
        let start = (part * per_part).min(n);
        let end = ((part + 1) * per_part).min(n);
        let args = (xp as *const f32, wp as *const W, op as *mut f32);
        // SAFETY: the slices above outlive `run`; parts write disjoint output columns
        // [start, end) of every row, all indices stay inside the asserted shapes, and the CPU
        // runs `isa` (asserted).
        #[cfg(target_arch = "x86_64")]
        unsafe {
            match isa {
                Isa::Avx512 => avx512::rows(args.0, args.1, args.2, (m, n, k), start..end),
                Isa::Avx2 => avx2::rows(args.0, args.1, args.2, (m, n, k), start..end),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (args, start, end);
    });
}

/// Weight rows computed together (their loads share each x load).
const BLOCK: usize = 2;

/// Output columns `cols` of all m rows, for either copy: `tile2` computes a tile of up to
/// `group` x rows against two weight rows, `tile1` against one; each takes (x rows, x, weight
/// rows, out, their output columns), x and out at the tile's first row.
///
/// A tile's BLOCK weight rows come from the two halves of `cols` (rows j and j + half),
/// not from adjacent rows: two streams that run side by side through the same few KiB of
/// a matrix (adjacent rows are 2.3-6 KiB apart here) defeat the CPU's stream prefetcher.
/// Measured on one core of this AMD EPYC, 49152 x 576 float32: 12 GB/s for adjacent rows,
/// 23 GB/s for rows half the range apart, 1 row (12 -> 23) and 4 rows (10 -> 18) alike.
/// SAFETY (caller): x [m, k], w [n, k] and out [m, n] are valid, cols lies in 0..n.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn pair_rows<W>(
    x: *const f32,
    w: *const W,
    out: *mut f32,
    (m, n, k): (usize, usize, usize),
    cols: std::ops::Range<usize>,
    group: usize,
    tile2: impl Fn(usize, *const f32, [*const W; 2], *mut f32, [usize; 2]),
    tile1: impl Fn(usize, *const f32, [*const W; 1], *mut f32, [usize; 1]),
) {
    let half = (cols.end - cols.start).div_ceil(BLOCK);
    for a in cols.start..cols.start + half {
        let b = a + half; // the partner row; none for the middle row of an odd range
        let mut i = 0;
        while i < m {
            let rows = group.min(m - i);
            let (xi, oi) = (x.add(i * k), out.add(i * n));
            if b < cols.end {
                tile2(rows, xi, [w.add(a * k), w.add(b * k)], oi, [a, b]);
            } else {
                tile1(rows, xi, [w.add(a * k)], oi, [a]);
            }
            i += rows;
        }
    }
}

/// A weight element: float32, or bfloat16 bits (u16) that each copy widens while loading.
#[cfg(target_arch = "x86_64")]
pub trait Weight: avx512::Weight + avx2::Weight {}
#[cfg(not(target_arch = "x86_64"))]
pub trait Weight: Copy + Sync {}
impl Weight for f32 {}
impl Weight for u16 {}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// A weight element the kernel loads as 16 float32 lanes.
    pub trait Weight: Copy + Sync {
        /// w[0..16] as float32.
        unsafe fn load(w: *const Self) -> __m512;
        /// w[0..len] as float32, zeros above (len < 16).
        unsafe fn load_tail(w: *const Self, len: usize) -> __m512;
    }

    impl Weight for f32 {
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load(w: *const f32) -> __m512 {
            _mm512_loadu_ps(w)
        }

        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load_tail(w: *const f32, len: usize) -> __m512 {
            _mm512_maskz_loadu_ps((1u16 << len) - 1, w)
        }
    }

    /// bfloat16 bits: a float32 with the low 16 bits zero, so widening is exact.
    impl Weight for u16 {
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load(w: *const u16) -> __m512 {
            let bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(w as *const __m256i));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(bits))
        }

        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load_tail(w: *const u16, len: usize) -> __m512 {
            let mut padded = [0u16; 16];
            std::ptr::copy_nonoverlapping(w, padded.as_mut_ptr(), len);
            Self::load(padded.as_ptr())
        }
    }

    /// x rows per register tile: GROUP x BLOCK accumulators + BLOCK weights + 1 x register
    /// fit in the 32 zmm registers.
    const GROUP: usize = 8;
    /// Software prefetch distance along a weight row, in elements (16 KiB of float32 weights),
    /// into L2 (`_MM_HINT_T1`), not L1: with several x rows per tile, weights prefetched into
    /// L1 (32 KiB here) evict the x rows and each other before they are used. Measured over
    /// the target's 211 matrices, 2 threads: 4 rows 1.15 -> 1.05 and 9 rows 1.45 -> 1.10
    /// times the 1-row time, which does not change.
    const PREFETCH: usize = 4096;

    /// Output columns `cols` of all m rows (`super::pair_rows`).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn rows<W: Weight>(
        x: *const f32,
        w: *const W,
        out: *mut f32,
        (m, n, k): (usize, usize, usize),
        cols: std::ops::Range<usize>,
    ) {
        super::pair_rows(
            x,
            w,
            out,
            (m, n, k),
            cols,
            GROUP,
            // SAFETY: pair_rows passes tiles inside the shapes `rows` was given
            |r, xi, wp, oi, c| unsafe { tiles::<W, 2>(r, xi, wp, oi, c, n, k) },
            |r, xi, wp, oi, c| unsafe { tiles::<W, 1>(r, xi, wp, oi, c, n, k) },
        )
    }

    /// `tile` for `rows` (1..=GROUP) x rows.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn tiles<W: Weight, const C: usize>(
        rows: usize,
        x: *const f32,
        w: [*const W; C],
        out: *mut f32,
        cols: [usize; C],
        n: usize,
        k: usize,
    ) {
        match rows {
            8 => tile::<W, 8, C>(x, w, out, cols, n, k),
            7 => tile::<W, 7, C>(x, w, out, cols, n, k),
            6 => tile::<W, 6, C>(x, w, out, cols, n, k),
            5 => tile::<W, 5, C>(x, w, out, cols, n, k),
            4 => tile::<W, 4, C>(x, w, out, cols, n, k),
            3 => tile::<W, 3, C>(x, w, out, cols, n, k),
            2 => tile::<W, 2, C>(x, w, out, cols, n, k),
            _ => tile::<W, 1, C>(x, w, out, cols, n, k),
        }
    }

    /// out[r, cols[c]] (row stride n) = dot(x[r], w[c]) for R x rows and C weight rows (each
    /// k long). The k loop runs in steps of 16 with a masked last step, so the sum for one
    /// output is the same sequence of operations whatever R and C are.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn tile<W: Weight, const R: usize, const C: usize>(
        x: *const f32,
        w: [*const W; C],
        out: *mut f32,
        cols: [usize; C],
        n: usize,
        k: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        let mut t = 0;
        while t + 16 <= k {
            let mut wv = [_mm512_setzero_ps(); C];
            for (c, v) in wv.iter_mut().enumerate() {
                let row = w[c].add(t);
                _mm_prefetch::<_MM_HINT_T1>(row.wrapping_add(PREFETCH) as *const i8);
                *v = W::load(row);
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let xv = _mm512_loadu_ps(x.add(r * k + t));
                for c in 0..C {
                    a[c] = _mm512_fmadd_ps(xv, wv[c], a[c]);
                }
            }
            t += 16;
        }
        if t < k {
            let mask: __mmask16 = (1u16 << (k - t)) - 1;
            let mut wv = [_mm512_setzero_ps(); C];
            for (c, v) in wv.iter_mut().enumerate() {
                *v = W::load_tail(w[c].add(t), k - t);
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let xv = _mm512_maskz_loadu_ps(mask, x.add(r * k + t));
                for c in 0..C {
                    a[c] = _mm512_fmadd_ps(xv, wv[c], a[c]);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            for (c, v) in a.iter().enumerate() {
                *out.add(r * n + cols[c]) = _mm512_reduce_add_ps(*v);
            }
        }
    }
}

/// The AVX2 copy of `avx512`, 8 lanes wide: the k loop runs in steps of 16 as two 8-lane
/// halves accumulated one after the other, then a step of 8 and a zero-padded tail where k
/// needs them, so one output's operations depend on k only.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// A weight element the kernel loads as 8 float32 lanes.
    pub trait Weight: Copy + Sync {
        /// w[0..8] as float32.
        unsafe fn load(w: *const Self) -> __m256;
        /// w[0..len] as float32, zeros above (len < 8).
        unsafe fn load_tail(w: *const Self, len: usize) -> __m256;
    }

    impl Weight for f32 {
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn load(w: *const f32) -> __m256 {
            _mm256_loadu_ps(w)
        }

        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn load_tail(w: *const f32, len: usize) -> __m256 {
            let mut padded = [0f32; 8];
            std::ptr::copy_nonoverlapping(w, padded.as_mut_ptr(), len);
            _mm256_loadu_ps(padded.as_ptr())
        }
    }

    /// bfloat16 bits: a float32 with the low 16 bits zero, so widening is exact.
    impl Weight for u16 {
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn load(w: *const u16) -> __m256 {
            let bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(w as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(bits))
        }

        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn load_tail(w: *const u16, len: usize) -> __m256 {
            let mut padded = [0u16; 8];
            std::ptr::copy_nonoverlapping(w, padded.as_mut_ptr(), len);
            Self::load(padded.as_ptr())
        }
    }

    /// x rows per register tile: GROUP x BLOCK accumulators + 2 x BLOCK weight halves + 1 x
    /// register fit in the 16 ymm registers.
    const GROUP: usize = 4;
    /// Software prefetch distance along a weight row, in elements, into L2 (as `avx512`).
    const PREFETCH: usize = 4096;

    /// Output columns `cols` of all m rows (`super::pair_rows`).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rows<W: Weight>(
        x: *const f32,
        w: *const W,
        out: *mut f32,
        (m, n, k): (usize, usize, usize),
        cols: std::ops::Range<usize>,
    ) {
        super::pair_rows(
            x,
            w,
            out,
            (m, n, k),
            cols,
            GROUP,
            // SAFETY: pair_rows passes tiles inside the shapes `rows` was given
            |r, xi, wp, oi, c| unsafe { tiles::<W, 2>(r, xi, wp, oi, c, n, k) },
            |r, xi, wp, oi, c| unsafe { tiles::<W, 1>(r, xi, wp, oi, c, n, k) },
        )
    }

    /// `tile` for `rows` (1..=GROUP) x rows.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tiles<W: Weight, const C: usize>(
        rows: usize,
        x: *const f32,
        w: [*const W; C],
        out: *mut f32,
        cols: [usize; C],
        n: usize,
        k: usize,
    ) {
        match rows {
            4 => tile::<W, 4, C>(x, w, out, cols, n, k),
            3 => tile::<W, 3, C>(x, w, out, cols, n, k),
            2 => tile::<W, 2, C>(x, w, out, cols, n, k),
            _ => tile::<W, 1, C>(x, w, out, cols, n, k),
        }
    }

    /// out[r, cols[c]] (row stride n) = dot(x[r], w[c]) for R x rows and C weight rows (each
    /// k long), one 8-lane accumulator per output.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<W: Weight, const R: usize, const C: usize>(
        x: *const f32,
        w: [*const W; C],
        out: *mut f32,
        cols: [usize; C],
        n: usize,
        k: usize,
    ) {
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let mut t = 0;
        while t + 16 <= k {
            let mut lo = [_mm256_setzero_ps(); C];
            let mut hi = [_mm256_setzero_ps(); C];
            for c in 0..C {
                let row = w[c].add(t);
                _mm_prefetch::<_MM_HINT_T1>(row.wrapping_add(PREFETCH) as *const i8);
                lo[c] = W::load(row);
                hi[c] = W::load(row.add(8));
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let xr = x.add(r * k + t);
                let (xl, xh) = (_mm256_loadu_ps(xr), _mm256_loadu_ps(xr.add(8)));
                for c in 0..C {
                    a[c] = _mm256_fmadd_ps(xh, hi[c], _mm256_fmadd_ps(xl, lo[c], a[c]));
                }
            }
            t += 16;
        }
        while t < k {
            let len = (k - t).min(8);
            let mut wv = [_mm256_setzero_ps(); C];
            for (c, v) in wv.iter_mut().enumerate() {
                *v = if len == 8 {
                    W::load(w[c].add(t))
                } else {
                    W::load_tail(w[c].add(t), len)
                };
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let mut xs = [0f32; 8];
                std::ptr::copy_nonoverlapping(x.add(r * k + t), xs.as_mut_ptr(), len);
                let xv = _mm256_loadu_ps(xs.as_ptr());
                for c in 0..C {
                    a[c] = _mm256_fmadd_ps(xv, wv[c], a[c]);
                }
            }
            t += len;
        }
        for (r, a) in acc.iter().enumerate() {
            for (c, v) in a.iter().enumerate() {
                *out.add(r * n + cols[c]) = sum8(*v);
            }
        }
    }

    /// The lanes' sum in a fixed order: (l_i + l_{i+4}), then pairs, then the last two.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn sum8(v: __m256) -> f32 {
        let four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let two = _mm_add_ps(four, _mm_movehl_ps(four, four));
        _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::values;

    fn reference(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k)
                    .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                    .sum::<f64>();
            }
        }
        out
    }

    /// `linear` on one copy of the kernel.
    fn linear_on(isa: Isa, x: &[f32], w: &[f32], out: &mut [f32], mnk: (usize, usize, usize)) {
        run::<f32>(isa, x, w, out, mnk, 2)
    }

    #[test]
    fn every_copy_matches_a_float64_reference_for_odd_shapes() {
        for isa in supported() {
            odd_shapes(isa);
        }
    }

    fn odd_shapes(isa: Isa) {
        // k with and without a masked tail, n odd and smaller than a thread part (a tile
        // pairs row j with row j + ceil(n / 2): 1 and 3 rows leave the middle one alone), m
        // across a group boundary
        for &(m, n, k) in &[
            (2, 1, 20),
            (5, 3, 33),
            (1, 5, 16),
            (3, 129, 37),
            (4, 576, 576),
            (9, 200, 1536),
            (16, 67, 3),
            (6, 70, 24),
            (3, 9, 45),
        ] {
            let (x, w) = (values(m * k, 1), values(n * k, 2));
            for threads in [1, 2, 3] {
                let mut out = vec![f32::NAN; m * n];
                run::<f32>(isa, &x, &w, &mut out, (m, n, k), threads);
                let want = reference(&x, &w, m, n, k);
                for (got, want) in out.iter().zip(&want) {
                    assert!(
                        (*got as f64 - want).abs() < 1e-4 * (k as f64).sqrt(),
                        "{isa:?} {m}x{n}x{k}"
                    );
                }
            }
        }
    }

    #[test]
    fn bf16_weights_give_the_float32_results_bit_for_bit() {
        for isa in supported() {
            bf16_weights(isa);
        }
    }

    fn bf16_weights(isa: Isa) {
        for &(m, n, k) in &[(1, 130, 576), (4, 67, 37), (16, 9, 1152), (5, 33, 27)] {
            let x = values(m * k, 5);
            // bf16 values: float32 bits with the low half cleared
            let bits: Vec<u16> = values(n * k, 6)
                .iter()
                .map(|v| (v.to_bits() >> 16) as u16)
                .collect();
            let wide: Vec<f32> = bits
                .iter()
                .map(|b| f32::from_bits((*b as u32) << 16))
                .collect();
            for threads in [1, 2] {
                let (mut a, mut b) = (vec![0.0; m * n], vec![0.0; m * n]);
                run::<f32>(isa, &x, &wide, &mut a, (m, n, k), threads);
                run::<u16>(isa, &x, &bits, &mut b, (m, n, k), threads);
                assert_eq!(a, b, "{isa:?} {m}x{n}x{k}");
            }
        }
    }

    #[test]
    fn a_row_is_bitwise_the_same_whatever_shares_the_call() {
        for isa in supported() {
            // k = 205: steps of 16, one of 8 and a padded tail of 5 in the AVX2 copy
            let (n, k) = (300, 205);
            let x = values(MAX_ROWS * k, 3);
            let w = values(n * k, 4);
            let mut all = vec![0.0; MAX_ROWS * n];
            linear_on(isa, &x, &w, &mut all, (MAX_ROWS, n, k));
            for i in 0..MAX_ROWS {
                let mut one = vec![0.0; n];
                run::<f32>(isa, &x[i * k..(i + 1) * k], &w, &mut one, (1, n, k), 1);
                assert_eq!(one, all[i * n..(i + 1) * n], "{isa:?} row {i}");
            }
        }
    }

    #[test]
    fn the_widest_copy_is_the_one_linear_runs() {
        let Some(widest) = isa() else { return };
        let (m, n, k) = (3, 40, 50);
        let (x, w) = (values(m * k, 7), values(n * k, 8));
        let (mut a, mut b) = (vec![0.0; m * n], vec![0.0; m * n]);
        linear(&x, &w, &mut a, m, n, k, 2);
        linear_on(widest, &x, &w, &mut b, (m, n, k));
        assert_eq!(a, b);
        assert_eq!(supported()[0], widest);
    }
}
