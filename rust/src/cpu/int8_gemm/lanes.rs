//! The VNNI copy's tiles for products of several x rows: one output per i32 lane.
//!
//! `tiles` puts one output's 32-element dot across the 8 lanes of a `dpbusd` and sums the
//! lanes (`hsum8`) for every (x row, weight chunk) pair: at 16 rows that horizontal sum, and
//! the weight chunk decoded again for every 4 rows, cost more than the dots. Here a chunk of
//! 8 weight rows is decoded once and transposed (`transpose8`) so that register g holds
//! bytes 4g..4g + 4 of each weight row, lane c being row c; a `dpbusd` of it with x's 4
//! bytes 4g..4g + 4 broadcast adds those 4 products into each row's lane, and 8 of them give
//! the 8 outputs' whole integer dots D, lane by lane, for every x row of the call.
//!
//! Numerics: the header's definition, term for term: D is the same exact integer (sum of
//! q * x less BIAS * sum(x), in i32), then per chunk acc = fma(D, dw * dx, acc) and for affine
//! formats acc = fma(mw, dx * sum(q), acc), the products and sums in the same order as
//! `tiles`: the same bits (the tests compare the copies).
//!
//! Registers: acc of every x row lives in a stack array (m <= MAX_ROWS), read and written once
//! per chunk; the 8 transposed weight registers stay in registers across the rows.
//! Long function: `group` is one kernel loop whose parts share the chunk's registers.

use super::formats::{Chunk, Format};
use super::{Geometry, QuantizedRows, QK};
use crate::cpu::small_gemm::MAX_ROWS;
use std::arch::x86_64::*;

/// Software prefetch distance along a weight row, in bytes, into L2 (as `tiles`).
const PREFETCH: usize = 16384;

/// Products of at least this many x rows take these tiles (measured with `int8_speed`:
/// below it `tiles`' 8-output tiles of one or two rows are as fast).
pub(super) const MIN_ROWS: usize = 3;

/// Output columns `cols` of every row of x for weights of format F (not `SCALED16`).
/// SAFETY (caller): as `tiles::vnni::columns`, and the CPU runs AVX-512 VNNI and VL.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
pub(super) unsafe fn columns<F: Format>(
    xq: &QuantizedRows,
    w: *const u8,
    out: *mut f32,
    g: &Geometry,
    cols: std::ops::Range<usize>,
) {
    let ((m, n, _), rb) = (g.mnk, g.row_bytes);
    debug_assert!(!F::SCALED16 && m <= MAX_ROWS);
    let mut acc = [_mm256_setzero_ps(); MAX_ROWS];
    let mut j = cols.start;
    while j < cols.end {
        // a row past the end of `cols` is computed from the last valid row and not stored
        let ws: [*const u8; 8] = std::array::from_fn(|c| w.add((j + c).min(cols.end - 1) * rb));
        group::<F>(xq, ws, &mut acc[..m]);
        let keep = (cols.end - j).min(8);
        for (r, a) in acc[..m].iter().enumerate() {
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), *a);
            std::ptr::copy_nonoverlapping(lanes.as_ptr(), out.add(r * n + j), keep);
        }
        j += 8;
    }
}

/// acc[r] lane c = the output of x row r with weight row `ws[c]` (header's definition).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn group<F: Format>(xq: &QuantizedRows, ws: [*const u8; 8], acc: &mut [__m256]) {
    let (m, k) = (xq.m, xq.k);
    acc.iter_mut().for_each(|a| *a = _mm256_setzero_ps());
    let mut shared = [F::shared(ws[0], 0); 8];
    let mut ch = [Chunk::zero(); 8];
    let mut t = 0;
    while t < k {
        for c in 0..8 {
            if t % F::BLOCK.0 == 0 {
                shared[c] = F::shared(ws[c], t);
            }
            if t % 64 == 0 {
                let ahead = t / F::BLOCK.0 * F::BLOCK.1 + PREFETCH;
                _mm_prefetch::<_MM_HINT_T1>(ws[c].wrapping_add(ahead) as *const i8);
            }
            ch[c] = F::chunk(ws[c], t, &shared[c]);
        }
        let wq = transpose8(ch.map(|c| c.q));
        let dw = lanes_of(&ch, |c| c.d);
        let mw = lanes_of(&ch, |c| c.m);
        let blk = t / QK * m; // this block's x scales, by row
        for (r, a) in acc.iter_mut().enumerate() {
            let x = xq.qs.as_ptr().add(r * k + t) as *const i32;
            let mut d = _mm256_set1_epi32(-*xq.sums.get_unchecked(blk + r) * F::BIAS);
            for (g, wg) in wq.iter().enumerate() {
                let xg = _mm256_set1_epi32(std::ptr::read_unaligned(x.add(g)));
                d = _mm256_dpbusd_epi32(d, *wg, xg);
            }
            let scale = _mm256_mul_ps(dw, _mm256_set1_ps(*xq.d.get_unchecked(blk + r)));
            *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), scale, *a);
            if F::OFFSET {
                *a = _mm256_fmadd_ps(mw, _mm256_set1_ps(*xq.ds.get_unchecked(blk + r)), *a);
            }
        }
        t += QK;
    }
}

/// Lane c = f(chunk c).
#[inline(always)]
unsafe fn lanes_of(ch: &[Chunk; 8], f: fn(&Chunk) -> f32) -> __m256 {
    _mm256_setr_ps(
        f(&ch[0]),
        f(&ch[1]),
        f(&ch[2]),
        f(&ch[3]),
        f(&ch[4]),
        f(&ch[5]),
        f(&ch[6]),
        f(&ch[7]),
    )
}

/// Out[g] lane c = 32-bit element g of v[c] (an 8 x 8 transpose of dwords).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn transpose8(v: [__m256i; 8]) -> [__m256i; 8] {
    // pairs of rows interleaved by dword, then by qword: u[i] holds dword i (low 128-bit
    // half) and dword i + 4 (high half) of rows 0-3 (u[0..4]) or 4-7 (u[4..8])
    let t: [__m256i; 8] = std::array::from_fn(|i| {
        let (a, b) = (v[i / 2 * 2], v[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_epi32(a, b)
        } else {
            _mm256_unpackhi_epi32(a, b)
        }
    });
    let u: [__m256i; 8] = std::array::from_fn(|i| {
        let base = i / 4 * 4; // t[base..base + 4]: rows 0-3 or 4-7
        let (lo, hi) = (t[base + (i % 4) / 2], t[base + 2 + (i % 4) / 2]);
        if i % 2 == 0 {
            _mm256_unpacklo_epi64(lo, hi)
        } else {
            _mm256_unpackhi_epi64(lo, hi)
        }
    });
    std::array::from_fn(|g| {
        let (a, b) = (u[g % 4], u[4 + g % 4]);
        if g < 4 {
            _mm256_permute2x128_si256::<0x20>(a, b)
        } else {
            _mm256_permute2x128_si256::<0x31>(a, b)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose8_puts_dword_g_of_row_c_in_lane_c_of_register_g() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            return;
        }
        let rows: [[i32; 8]; 8] =
            std::array::from_fn(|c| std::array::from_fn(|g| (10 * c + g) as i32));
        // SAFETY: the CPU runs AVX2 (checked); the arrays hold 8 i32 each.
        let out =
            unsafe { transpose8(rows.map(|r| _mm256_loadu_si256(r.as_ptr() as *const __m256i))) };
        for (g, reg) in out.iter().enumerate() {
            let mut lanes = [0i32; 8];
            // SAFETY: lanes holds 8 i32.
            unsafe { _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, *reg) };
            let want: [i32; 8] = std::array::from_fn(|c| (10 * c + g) as i32);
            assert_eq!(lanes, want, "register {g}");
        }
    }
}
