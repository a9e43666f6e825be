//! `out = x @ w^T` in float32 for the rows of a CPU decode or verify step (up to `MAX_ROWS`),
//! from float32, bfloat16 or GGUF-quantized weights (`quant`).
//!
//! The one piece of tensor math on the Rust side, and why: at batch 1 a plain decode step
//! multiplies 1 row and a K = 3 verify step 4 rows by every weight matrix. The work is memory
//! bound (each weight is read once per step), but MKL, which `F.linear` calls, changes strategy
//! at 4 rows and takes ~1.9x the 1-row time (benchmarks/cpu_small_gemm.py), and on CPUs without
//! AVX-512 reads a 1-row step's weights at a fraction of the memory bandwidth. This kernel reads
//! each weight row once for all rows of `x` (up to `MAX_ROWS`), so 4 rows cost ~1.1x one, and
//! reads a quantized checkpoint's blocks directly, expanding them in registers to the exact
//! float32 values of the dequantized checkpoint (~7x fewer bytes for Q4_1).
//!
//! Two copies: AVX-512F (16 lanes) and AVX2 with FMA (8 lanes); the widest the CPU runs is used.
//! Shapes: x [m, k], w [n, k] (a torch Linear weight, row-major; a quantized row is k / QK
//! blocks), out [m, n], all contiguous.
//! Numerics: every output is the same sum in the same order whatever m, the thread count, the
//! row blocking and the weight format (lanes over k in fixed steps, fused multiply-add, then
//! one fixed lane reduction), so a row's result does not depend on which other rows share the
//! call -- a verify step computes bit for bit what a 1-row decode step would -- and quantized
//! weights give bit for bit the result of their dequantized float32 copy. The two copies sum in
//! different orders: results agree to rounding, not bit for bit, across CPUs.

use crate::cpu::omp;
use crate::cpu::quant::WeightType;

/// Runs `$body` with `$w` the loader type of `$ty` (one monomorphised copy per format).
macro_rules! dispatch {
    ($ty:expr, $w:ident => $body:expr) => {{
        use crate::cpu::quant::avx512 as q;
        match $ty {
            WeightType::F32 => {
                type $w = q::F32;
                $body
            }
            WeightType::F16 => {
                type $w = q::F16;
                $body
            }
            WeightType::Bf16 => {
                type $w = q::Bf16;
                $body
            }
            WeightType::Q4_0 => {
                type $w = q::Q4_0;
                $body
            }
            WeightType::Q4_1 => {
                type $w = q::Q4_1;
                $body
            }
            WeightType::Q5_0 => {
                type $w = q::Q5_0;
                $body
            }
            WeightType::Q5_1 => {
                type $w = q::Q5_1;
                $body
            }
            WeightType::Q8_0 => {
                type $w = q::Q8_0;
                $body
            }
            WeightType::Q4K => {
                type $w = q::Q4K;
                $body
            }
            WeightType::Q6K => {
                type $w = q::Q6K;
                $body
            }
            WeightType::Mxfp4 => {
                type $w = q::Mxfp4;
                $body
            }
        }
    }};
}

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

/// Whether this CPU runs the `isa` copy (F16C too, for the quantized formats' fp16 scales).
pub fn runs(isa: Isa) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let f16c = std::arch::is_x86_feature_detected!("f16c");
        match isa {
            Isa::Avx512 => std::arch::is_x86_feature_detected!("avx512f") && f16c,
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && f16c
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
    linear_typed(WeightType::F32, x, as_bytes(w), out, (m, n, k), threads)
}

/// `linear` over weights `w` of any `WeightType` (n rows of `ty.row_bytes(k)` bytes): bit for
/// bit `linear` of their float32 values (`quant::dequantize_row`).
pub fn linear_typed(
    ty: WeightType,
    x: &[f32],
    w: &[u8],
    out: &mut [f32],
    mnk: (usize, usize, usize),
    threads: usize,
) {
    run(widest(), ty, x, w, out, mnk, threads)
}

/// Rows `ids` of a [rows, k] matrix of type `ty` as float32 into out [ids.len(), k], through
/// the GEMM's own loaders (the same values it multiplies): an embedding lookup. Panics on an
/// id out of range or a size mismatch.
pub fn gather_rows(ty: WeightType, w: &[u8], k: usize, ids: &[i64], out: &mut [f32]) {
    gather_rows_on(widest(), ty, w, k, ids, out)
}

/// `gather_rows` on one copy of the kernel.
pub(crate) fn gather_rows_on(
    isa: Isa,
    ty: WeightType,
    w: &[u8],
    k: usize,
    ids: &[i64],
    out: &mut [f32],
) {
    assert!(runs(isa), "small_gemm: this CPU cannot run {isa:?}");
    let row_bytes = ty.row_bytes(k).expect("k is a whole number of blocks");
    assert!(w.len().is_multiple_of(row_bytes) && out.len() == ids.len() * k);
    let rows = (w.len() / row_bytes) as i64;
    for (&id, dst) in ids.iter().zip(out.chunks_exact_mut(k)) {
        assert!((0..rows).contains(&id), "row {id} of {rows}");
        let row = &w[id as usize * row_bytes..][..row_bytes];
        // SAFETY: row holds k elements of type ty (sizes checked), dst k floats, and the CPU
        // runs `isa`.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            dispatch!(ty, W => match isa {
                Isa::Avx512 => avx512::expand_row::<W>(row.as_ptr(), k, dst.as_mut_ptr()),
                Isa::Avx2 => avx2::expand_row::<W>(row.as_ptr(), k, dst.as_mut_ptr()),
            })
        }
    }
}

fn as_bytes<T>(w: &[T]) -> &[u8] {
    // SAFETY: any initialised memory may be read as bytes.
    unsafe { std::slice::from_raw_parts(w.as_ptr() as *const u8, std::mem::size_of_val(w)) }
}

pub(crate) fn widest() -> Isa {
    isa().expect("small_gemm needs AVX-512F or AVX2 with FMA (and F16C)")
}

fn run(
    isa: Isa,
    ty: WeightType,
    x: &[f32],
    w: &[u8],
    out: &mut [f32],
    (m, n, k): (usize, usize, usize),
    threads: usize,
) {
    assert!(runs(isa), "small_gemm: this CPU cannot run {isa:?}");
    let geometry = Geometry::checked("small_gemm", ty, (x.len(), w.len(), out.len()), (m, n, k));
    let (xp, wp, op) = (
        x.as_ptr() as usize,
        w.as_ptr() as usize,
        out.as_mut_ptr() as usize,
    );
    split_columns(n, threads, &|cols| {
        // SAFETY: the slices above outlive `run`; parts write disjoint output columns
        // [start, end) of every row, inside the asserted shapes; the CPU runs `isa`.
        unsafe {
            columns_on(
                isa,
                ty,
                xp as *const f32,
                wp as *const u8,
                op as *mut f32,
                &geometry,
                cols,
            )
        }
    });
}

/// Output columns `cols` of out = x @ w^T (every row) on the calling thread: the part of a
/// call `run` hands each thread, for callers that split the work themselves (`moe`).
///
/// # Safety
/// x, w and out hold the buffers `g` describes (x [m, k], n rows of `g.row_bytes`, out
/// [m, n]), cols lies in 0..n, no other thread writes those columns meanwhile, and the CPU
/// runs `isa`.
pub(crate) unsafe fn columns_on(
    isa: Isa,
    ty: WeightType,
    x: *const f32,
    w: *const u8,
    out: *mut f32,
    g: &Geometry,
    cols: std::ops::Range<usize>,
) {
    #[cfg(target_arch = "x86_64")]
    dispatch!(ty, W => match isa {
        Isa::Avx512 => avx512::rows::<W>(x, w, out, g, cols),
        Isa::Avx2 => avx2::rows::<W>(x, w, out, g, cols),
    });
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (isa, ty, x, w, out, g, cols);
}

/// Runs `f` over parts of the output columns 0..n on up to `threads` threads of libgomp's team
/// (`omp`): parts of whole multiples of BLOCK, and for small matrices fewer threads, so each
/// part keeps >= MIN_PART_ROWS columns (handing out a part costs ~1 µs).
pub(crate) fn split_columns(n: usize, threads: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
    const MIN_PART_ROWS: usize = 64;
    let parts = threads.clamp(1, (n / MIN_PART_ROWS).max(1));
    let per_part = n.div_ceil(parts).div_ceil(BLOCK) * BLOCK;
    omp::run(parts, &|part| {
        f((part * per_part).min(n)..((part + 1) * per_part).min(n))
    });
}

/// The sizes of one call: x [m, k], w n rows of `row_bytes`, out [m, n] (this GEMM's and
/// `int8_gemm`'s).
pub(crate) struct Geometry {
    pub(crate) mnk: (usize, usize, usize),
    pub(crate) row_bytes: usize,
}

impl Geometry {
    /// The geometry of a call with buffers of `lens` (x, w bytes, out) elements; panics, naming
    /// `kernel`, unless 1 <= m <= MAX_ROWS and the buffers hold x [m, k], n rows of `ty`
    /// (k a whole number of its blocks) and out [m, n].
    pub(crate) fn checked(
        kernel: &str,
        ty: WeightType,
        (x, w, out): (usize, usize, usize),
        (m, n, k): (usize, usize, usize),
    ) -> Self {
        assert!(
            (1..=MAX_ROWS).contains(&m),
            "{kernel} takes 1..={MAX_ROWS} rows, got {m}"
        );
        let row_bytes = ty.row_bytes(k);
        assert!(
            row_bytes.is_some_and(|r| w == n * r) && x == m * k && out == m * n,
            "shape mismatch"
        );
        Geometry {
            mnk: (m, n, k),
            row_bytes: row_bytes.unwrap_or_default(),
        }
    }
}

/// Weight rows computed together (their loads share each x load).
const BLOCK: usize = 2;

/// A weight format both copies load (`quant::avx512::Load`, `quant::avx2::Load`).
#[cfg(target_arch = "x86_64")]
pub trait Weight: crate::cpu::quant::avx512::Load + crate::cpu::quant::avx2::Load {
    /// Bytes per `PER` elements, for the software prefetch's distance along a row.
    const PER: (usize, usize);
}
#[cfg(target_arch = "x86_64")]
mod weights {
    use super::Weight;
    use crate::cpu::quant::avx512::*;
    impl Weight for F32 {
        const PER: (usize, usize) = (1, 4);
    }
    impl Weight for F16 {
        const PER: (usize, usize) = (1, 2);
    }
    impl Weight for Bf16 {
        const PER: (usize, usize) = (1, 2);
    }
    impl Weight for Q4_0 {
        const PER: (usize, usize) = (32, 18);
    }
    impl Weight for Q4_1 {
        const PER: (usize, usize) = (32, 20);
    }
    impl Weight for Q5_0 {
        const PER: (usize, usize) = (32, 22);
    }
    impl Weight for Q5_1 {
        const PER: (usize, usize) = (32, 24);
    }
    impl Weight for Q8_0 {
        const PER: (usize, usize) = (32, 34);
    }
    impl Weight for Q4K {
        const PER: (usize, usize) = (256, 144);
    }
    impl Weight for Q6K {
        const PER: (usize, usize) = (256, 210);
    }
    impl Weight for Mxfp4 {
        const PER: (usize, usize) = (32, 17);
    }
}

/// The byte offset of element t in a row of format W.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn byte_offset<W: Weight>(t: usize) -> usize {
    t / W::PER.0 * W::PER.1
}

/// One instruction set's copy: its tile sizes and functions (`avx512`, `avx2`).
#[cfg(target_arch = "x86_64")]
trait Kernel {
    /// x rows per register tile.
    const GROUP: usize;
    /// out[r, cols[c]] (row stride n) = dot(x[r], row c) for `rows` (1..=GROUP) x rows.
    unsafe fn tiles<W: Weight, const C: usize>(
        rows: usize,
        x: *const f32,
        w: [*const u8; C],
        out: *mut f32,
        cols: [usize; C],
        nk: (usize, usize),
    );
    /// The k elements of `row` as float32 into out.
    unsafe fn expand_row<W: Weight>(row: *const u8, k: usize, out: *mut f32);
}

/// Output columns `cols` of all m rows for either copy: tiles of up to `K::GROUP` x rows
/// against two weight rows (or one).
///
/// A tile's BLOCK weight rows come from the two halves of `cols` (rows j and j + half),
/// not from adjacent rows: two streams that run side by side through the same few KiB of
/// a matrix (adjacent rows are 2.3-6 KiB apart here) defeat the CPU's stream prefetcher.
/// Measured on one core of this AMD EPYC, 49152 x 576 float32: 12 GB/s for adjacent rows,
/// 23 GB/s for rows half the range apart, 1 row (12 -> 23) and 4 rows (10 -> 18) alike.
///
/// A quantized pair shared by more than one tile of x rows is expanded once into float32
/// scratch (in L1) and the tiles read that: the same values, so the same sums, without
/// expanding the blocks again for every group of x rows.
/// SAFETY (caller): x [m, k], w (n rows of g.row_bytes) and out [m, n] are valid, cols lies
/// in 0..n, and the CPU runs the copy `K` is.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pair_rows<K: Kernel, W: Weight>(
    x: *const f32,
    w: *const u8,
    out: *mut f32,
    g: &Geometry,
    cols: std::ops::Range<usize>,
) {
    let ((m, n, k), rb) = (g.mnk, g.row_bytes);
    let expand = W::PER.0 > 1 && m > K::GROUP;
    let mut scratch = if expand {
        vec![0f32; 2 * k]
    } else {
        Vec::new()
    };
    let half = (cols.end - cols.start).div_ceil(BLOCK);
    for a in cols.start..cols.start + half {
        let b = a + half; // the partner row; none for the middle row of an odd range
        let pair = [w.add(a * rb), w.add(b.min(n - 1) * rb)];
        if expand {
            let s = scratch.as_mut_ptr();
            K::expand_row::<W>(pair[0], k, s);
            if b < cols.end {
                K::expand_row::<W>(pair[1], k, s.add(k));
            }
            let rows = [s as *const u8, s.add(k) as *const u8];
            tile_rows::<K, super::quant::avx512::F32>(x, rows, out, (m, n, k), [a, b], cols.end);
        } else {
            tile_rows::<K, W>(x, pair, out, (m, n, k), [a, b], cols.end);
        }
    }
}

/// Every group of x rows against weight rows `ab` (`ab[1]` only when below `end`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tile_rows<K: Kernel, W: Weight>(
    x: *const f32,
    rows: [*const u8; 2],
    out: *mut f32,
    (m, n, k): (usize, usize, usize),
    ab: [usize; 2],
    end: usize,
) {
    let mut i = 0;
    while i < m {
        let r = K::GROUP.min(m - i);
        let (xi, oi) = (x.add(i * k), out.add(i * n));
        if ab[1] < end {
            K::tiles::<W, 2>(r, xi, rows, oi, ab, (n, k));
        } else {
            K::tiles::<W, 1>(r, xi, [rows[0]], oi, [ab[0]], (n, k));
        }
        i += r;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{byte_offset, Geometry, Kernel, Weight};
    use crate::cpu::quant::avx512::Load;
    use std::arch::x86_64::*;

    /// x rows per register tile: GROUP x BLOCK accumulators + BLOCK weights + 1 x register
    /// fit in the 32 zmm registers.
    const GROUP: usize = 8;
    /// Software prefetch distance along a weight row, in bytes (16 KiB), into L2
    /// (`_MM_HINT_T1`), not L1: with several x rows per tile, weights prefetched into L1
    /// (32 KiB here) evict the x rows and each other before they are used. Measured over the
    /// target's 211 float32 matrices, 2 threads: 4 rows 1.15 -> 1.05 and 9 rows 1.45 -> 1.10
    /// times the 1-row time, which does not change.
    const PREFETCH: usize = 16384;

    struct Avx512;

    impl Kernel for Avx512 {
        const GROUP: usize = GROUP;

        #[inline]
        #[target_feature(enable = "avx512f,f16c")]
        unsafe fn tiles<W: Weight, const C: usize>(
            rows: usize,
            x: *const f32,
            w: [*const u8; C],
            out: *mut f32,
            cols: [usize; C],
            nk: (usize, usize),
        ) {
            match rows {
                8 => tile::<W, 8, C>(x, w, out, cols, nk),
                7 => tile::<W, 7, C>(x, w, out, cols, nk),
                6 => tile::<W, 6, C>(x, w, out, cols, nk),
                5 => tile::<W, 5, C>(x, w, out, cols, nk),
                4 => tile::<W, 4, C>(x, w, out, cols, nk),
                3 => tile::<W, 3, C>(x, w, out, cols, nk),
                2 => tile::<W, 2, C>(x, w, out, cols, nk),
                _ => tile::<W, 1, C>(x, w, out, cols, nk),
            }
        }

        #[inline]
        #[target_feature(enable = "avx512f,f16c")]
        unsafe fn expand_row<W: Weight>(row: *const u8, k: usize, out: *mut f32) {
            expand_row::<W>(row, k, out)
        }
    }

    /// Output columns `cols` of all m rows (`super::pair_rows`).
    #[target_feature(enable = "avx512f,f16c")]
    pub(super) unsafe fn rows<W: Weight>(
        x: *const f32,
        w: *const u8,
        out: *mut f32,
        g: &Geometry,
        cols: std::ops::Range<usize>,
    ) {
        super::pair_rows::<Avx512, W>(x, w, out, g, cols)
    }

    /// The k elements of `row` as float32 into out (`super::gather_rows`).
    #[target_feature(enable = "avx512f,f16c")]
    pub(super) unsafe fn expand_row<W: Weight>(row: *const u8, k: usize, out: *mut f32) {
        let mut t = 0;
        while <W as Load>::BLOCKED && t < k {
            let [a, b] = <W as Load>::load32(row, t);
            _mm512_storeu_ps(out.add(t), a);
            _mm512_storeu_ps(out.add(t + 16), b);
            t += 32;
        }
        while t + 16 <= k {
            _mm512_storeu_ps(out.add(t), <W as Load>::load(row, t));
            t += 16;
        }
        if t < k {
            _mm512_mask_storeu_ps(
                out.add(t),
                (1u16 << (k - t)) - 1,
                <W as Load>::load_tail(row, t, k - t),
            );
        }
    }

    /// out[r, cols[c]] (row stride n) = dot(x[r], w[c]) for R x rows and C weight rows (each
    /// k long). The k loop runs in steps of 16 with a masked last step, so the sum for one
    /// output is the same sequence of operations whatever R, C and the weight format are.
    #[inline]
    #[target_feature(enable = "avx512f,f16c")]
    unsafe fn tile<W: Weight, const R: usize, const C: usize>(
        x: *const f32,
        w: [*const u8; C],
        out: *mut f32,
        cols: [usize; C],
        (n, k): (usize, usize),
    ) {
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        let mut t = 0;
        // block formats: 32 elements (a block or sub-block, its scales read once) per step, as
        // two steps of 16 in order; k is a whole number of blocks, so no tail
        while <W as Load>::BLOCKED && t < k {
            let mut wv = [[_mm512_setzero_ps(); 2]; C];
            for (c, v) in wv.iter_mut().enumerate() {
                if t % 64 == 0 {
                    let ahead = w[c].wrapping_add(byte_offset::<W>(t) + PREFETCH);
                    _mm_prefetch::<_MM_HINT_T1>(ahead as *const i8);
                }
                *v = <W as Load>::load32(w[c], t);
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let x0 = _mm512_loadu_ps(x.add(r * k + t));
                let x1 = _mm512_loadu_ps(x.add(r * k + t + 16));
                for c in 0..C {
                    a[c] = _mm512_fmadd_ps(x1, wv[c][1], _mm512_fmadd_ps(x0, wv[c][0], a[c]));
                }
            }
            t += 32;
        }
        while t + 16 <= k {
            let mut wv = [_mm512_setzero_ps(); C];
            for (c, v) in wv.iter_mut().enumerate() {
                let ahead = w[c].wrapping_add(byte_offset::<W>(t) + PREFETCH);
                _mm_prefetch::<_MM_HINT_T1>(ahead as *const i8);
                *v = <W as Load>::load(w[c], t);
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
                *v = <W as Load>::load_tail(w[c], t, k - t);
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
    use super::{byte_offset, Geometry, Kernel, Weight};
    use crate::cpu::quant::avx2::Load;
    use std::arch::x86_64::*;

    /// x rows per register tile: GROUP x BLOCK accumulators + 2 x BLOCK weight halves + 1 x
    /// register fit in the 16 ymm registers.
    const GROUP: usize = 4;
    /// Software prefetch distance along a weight row, in bytes, into L2 (as `avx512`).
    const PREFETCH: usize = 16384;

    struct Avx2;

    impl Kernel for Avx2 {
        const GROUP: usize = GROUP;

        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn tiles<W: Weight, const C: usize>(
            rows: usize,
            x: *const f32,
            w: [*const u8; C],
            out: *mut f32,
            cols: [usize; C],
            nk: (usize, usize),
        ) {
            match rows {
                4 => tile::<W, 4, C>(x, w, out, cols, nk),
                3 => tile::<W, 3, C>(x, w, out, cols, nk),
                2 => tile::<W, 2, C>(x, w, out, cols, nk),
                _ => tile::<W, 1, C>(x, w, out, cols, nk),
            }
        }

        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn expand_row<W: Weight>(row: *const u8, k: usize, out: *mut f32) {
            expand_row::<W>(row, k, out)
        }
    }

    /// Output columns `cols` of all m rows (`super::pair_rows`).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows<W: Weight>(
        x: *const f32,
        w: *const u8,
        out: *mut f32,
        g: &Geometry,
        cols: std::ops::Range<usize>,
    ) {
        super::pair_rows::<Avx2, W>(x, w, out, g, cols)
    }

    /// The k elements of `row` as float32 into out (`super::gather_rows`).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn expand_row<W: Weight>(row: *const u8, k: usize, out: *mut f32) {
        let mut t = 0;
        while <W as Load>::BLOCKED && t < k {
            for (i, v) in <W as Load>::load32(row, t).iter().enumerate() {
                _mm256_storeu_ps(out.add(t + 8 * i), *v);
            }
            t += 32;
        }
        while t + 8 <= k {
            _mm256_storeu_ps(out.add(t), <W as Load>::load(row, t));
            t += 8;
        }
        if t < k {
            let mut rest = [0f32; 8];
            _mm256_storeu_ps(rest.as_mut_ptr(), <W as Load>::load_tail(row, t, k - t));
            std::ptr::copy_nonoverlapping(rest.as_ptr(), out.add(t), k - t);
        }
    }

    /// out[r, cols[c]] (row stride n) = dot(x[r], w[c]) for R x rows and C weight rows (each
    /// k long), one 8-lane accumulator per output.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<W: Weight, const R: usize, const C: usize>(
        x: *const f32,
        w: [*const u8; C],
        out: *mut f32,
        cols: [usize; C],
        (n, k): (usize, usize),
    ) {
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let mut t = 0;
        // block formats: 32 elements per step as four steps of 8 in order (no tail)
        while <W as Load>::BLOCKED && t < k {
            let mut wv = [[_mm256_setzero_ps(); 4]; C];
            for (c, v) in wv.iter_mut().enumerate() {
                let ahead = w[c].wrapping_add(byte_offset::<W>(t) + PREFETCH);
                _mm_prefetch::<_MM_HINT_T1>(ahead as *const i8);
                *v = <W as Load>::load32(w[c], t);
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let xr = x.add(r * k + t);
                for (c, v) in wv.iter().enumerate() {
                    for (i, w) in v.iter().enumerate() {
                        a[c] = _mm256_fmadd_ps(_mm256_loadu_ps(xr.add(8 * i)), *w, a[c]);
                    }
                }
            }
            t += 32;
        }
        while t + 16 <= k {
            let mut lo = [_mm256_setzero_ps(); C];
            let mut hi = [_mm256_setzero_ps(); C];
            for c in 0..C {
                let ahead = w[c].wrapping_add(byte_offset::<W>(t) + PREFETCH);
                _mm_prefetch::<_MM_HINT_T1>(ahead as *const i8);
                lo[c] = <W as Load>::load(w[c], t);
                hi[c] = <W as Load>::load(w[c], t + 8);
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
                    <W as Load>::load(w[c], t)
                } else {
                    <W as Load>::load_tail(w[c], t, len)
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
        run(isa, WeightType::F32, x, as_bytes(w), out, mnk, 2)
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
                run(
                    isa,
                    WeightType::F32,
                    &x,
                    as_bytes(&w),
                    &mut out,
                    (m, n, k),
                    threads,
                );
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
    fn sixteen_bit_weights_give_the_float32_results_bit_for_bit() {
        for isa in supported() {
            for ty in [WeightType::Bf16, WeightType::F16] {
                sixteen_bit_weights(isa, ty);
            }
        }
    }

    fn sixteen_bit_weights(isa: Isa, ty: WeightType) {
        for &(m, n, k) in &[(1, 130, 576), (4, 67, 37), (16, 9, 1152), (5, 33, 27)] {
            let x = values(m * k, 5);
            // the top half of float32 bits: bf16 values; as fp16, finite ones (inf/NaN
            // exponents lowered), subnormals included
            let bits: Vec<u16> = values(n * k, 6)
                .iter()
                .map(|v| (v.to_bits() >> 16) as u16)
                .map(|h| match ty {
                    WeightType::F16 if h & 0x7c00 == 0x7c00 => h & !0x4000,
                    _ => h,
                })
                .collect();
            let mut wide = vec![0f32; n * k];
            crate::cpu::quant::dequantize_row(ty, as_bytes(&bits), &mut wide);
            for threads in [1, 2] {
                let (mut a, mut b) = (vec![0.0; m * n], vec![0.0; m * n]);
                let w32 = as_bytes(&wide);
                run(isa, WeightType::F32, &x, w32, &mut a, (m, n, k), threads);
                run(isa, ty, &x, as_bytes(&bits), &mut b, (m, n, k), threads);
                let same = a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits());
                assert!(same, "{isa:?} {ty:?} {m}x{n}x{k}");
            }
        }
    }

    #[test]
    fn quantized_weights_give_the_dequantized_results_bit_for_bit() {
        use crate::cpu::quant::{dequantize_row, ALL};
        for isa in supported() {
            for ty in ALL.into_iter().filter(|t| t.is_quantized()) {
                // 1 row, a full tile, one over (the expanded pair path), many groups; n odd
                let (n, k) = (67, 2 * ty.block().0.max(256));
                let blocks = crate::testutil::random_blocks(ty, n, k, 11 + ty.ggml_id() as u64);
                let rb = ty.row_bytes(k).unwrap();
                let mut wide = vec![0f32; n * k];
                for (r, o) in blocks.chunks_exact(rb).zip(wide.chunks_exact_mut(k)) {
                    dequantize_row(ty, r, o);
                }
                for (m, threads) in [(1, 1), (4, 2), (8, 1), (9, 2), (20, 3), (MAX_ROWS, 2)] {
                    let x = values(m * k, m as u64);
                    let (mut a, mut b) = (vec![0.0; m * n], vec![0.0; m * n]);
                    run(
                        isa,
                        WeightType::F32,
                        &x,
                        as_bytes(&wide),
                        &mut a,
                        (m, n, k),
                        threads,
                    );
                    run(isa, ty, &x, &blocks, &mut b, (m, n, k), threads);
                    let same = a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits());
                    assert!(same, "{isa:?} {ty:?} m={m}");
                }
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
                run(
                    isa,
                    WeightType::F32,
                    &x[i * k..(i + 1) * k],
                    as_bytes(&w),
                    &mut one,
                    (1, n, k),
                    1,
                );
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
