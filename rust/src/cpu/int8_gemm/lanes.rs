//! Tiles for products of several x rows, one output per i32 lane (both copies, as `tiles`).
//!
//! `tiles` puts one output's 32-element dot across the 8 lanes of a register and sums the
//! lanes (`hsum8`) for every (x row, weight chunk) pair: at 16 rows that horizontal sum, and
//! the weight chunk decoded again for every 4 rows, cost more than the dots. Here a chunk of
//! 8 weight rows is decoded once and transposed (`transpose8`) so that register g holds
//! bytes 4g..4g + 4 of each weight row, lane c being row c; a `dpbusd` (VNNI) or a
//! `maddubs` + `madd` (AVX2, and Q6_K's multipliers) of it with x's 4 bytes 4g..4g + 4
//! broadcast adds those 4 products into each row's lane, and 8 of them give the 8 outputs'
//! whole integer dots D, lane by lane, for every x row of the call.
//!
//! Numerics: the header's definition, term for term: D is the same exact integer (sum of
//! q * x less BIAS * sum(x), in i32), then per chunk acc = fma(D, dw * dx, acc) and for affine
//! formats acc = fma(mw, dx * sum(q), acc), the products and sums in the same order as
//! `tiles`: the same bits (the tests compare the copies and a row alone with the 9-row call).
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

/// Products of at least this many x rows take these tiles: at 4 rows they run 1.0-1.4x
/// `tiles`' and from 16 rows 1.5-2.8x (`int8_speed`, AVX-512 VM); one and two rows keep
/// `tiles`' 8-output tiles, which transpose nothing (not measured against these).
pub(super) const MIN_ROWS: usize = 3;

macro_rules! copy {
    ($name:ident, $features:literal, $vnni:expr) => {
        pub(super) mod $name {
            use super::*;

            /// Output columns `cols` of every row of x for weights of format F.
            /// SAFETY (caller): as `tiles::$name::columns`.
            #[target_feature(enable = $features)]
            pub(in crate::cpu::int8_gemm) unsafe fn columns<F: Format>(
                xq: &QuantizedRows,
                w: *const u8,
                out: *mut f32,
                g: &Geometry,
                cols: std::ops::Range<usize>,
            ) {
                let ((m, n, _), rb) = (g.mnk, g.row_bytes);
                debug_assert!(m <= MAX_ROWS);
                let mut acc = [_mm256_setzero_ps(); MAX_ROWS];
                let mut j = cols.start;
                while j < cols.end {
                    // a row past the end of `cols` is computed from the last valid row and
                    // not stored
                    let ws: [*const u8; 8] =
                        std::array::from_fn(|c| w.add((j + c).min(cols.end - 1) * rb));
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

            /// acc[r] lane c = the output of x row r with weight row `ws[c]` (the header's
            /// definition).
            #[inline]
            #[target_feature(enable = $features)]
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
                    let wt = Transposed::of::<F>(&ch, $vnni);
                    let blk = t / QK * m; // this block's x scales, by row
                    for (r, a) in acc.iter_mut().enumerate() {
                        let x = xq.qs.as_ptr().add(r * k + t) as *const i32;
                        let sum = *xq.sums.get_unchecked(blk + r);
                        // dpbusd takes q as stored: less BIAS * sum(x); maddubs takes q - BIAS
                        let mut d = _mm256_set1_epi32(if $vnni && !F::SCALED16 {
                            -sum * F::BIAS
                        } else {
                            0
                        });
                        for g in 0..8 {
                            let xg = _mm256_set1_epi32(std::ptr::read_unaligned(x.add(g)));
                            d = if $vnni && !F::SCALED16 {
                                _mm256_dpbusd_epi32(d, wt.q[g], xg)
                            } else if F::BIAS != 0 {
                                let p =
                                    _mm256_maddubs_epi16(wt.mag[g], _mm256_sign_epi8(xg, wt.q[g]));
                                _mm256_add_epi32(d, _mm256_madd_epi16(p, wt.mul[g]))
                            } else {
                                let p = _mm256_maddubs_epi16(wt.q[g], xg);
                                _mm256_add_epi32(d, _mm256_madd_epi16(p, wt.mul[g]))
                            };
                        }
                        let scale =
                            _mm256_mul_ps(wt.d, _mm256_set1_ps(*xq.d.get_unchecked(blk + r)));
                        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), scale, *a);
                        if F::OFFSET {
                            let ds = _mm256_set1_ps(*xq.ds.get_unchecked(blk + r));
                            *a = _mm256_fmadd_ps(wt.m, ds, *a);
                        }
                    }
                    t += QK;
                }
            }
        }
    };
}

copy!(avx2, "avx2,fma,f16c", false);
copy!(vnni, "avx2,fma,f16c,avx512vnni,avx512vl", true);

/// 8 weight rows' chunks with register g holding their bytes 4g..4g + 4, lane c from row c:
/// q as stored (the `dpbusd` operand), or, where the dot goes through `maddubs`, q - BIAS
/// signed in `q` and its magnitude in `mag` (BIAS != 0), with `mul` the i16 multipliers of
/// those bytes' pairs; d and m the rows' scales and offsets by lane.
struct Transposed {
    q: [__m256i; 8],
    mag: [__m256i; 8],
    mul: [__m256i; 8],
    d: __m256,
    m: __m256,
}

impl Transposed {
    #[inline(always)]
    unsafe fn of<F: Format>(ch: &[Chunk; 8], vnni: bool) -> Self {
        let ones = [_mm256_set1_epi16(1); 8];
        let bytes = |f: fn(&Chunk) -> __m256i| transpose8(std::array::from_fn(|c| f(&ch[c])));
        let (mut q, mut mag, mut mul) = (bytes(|c| c.q), ones, ones);
        if !vnni || F::SCALED16 {
            if F::SCALED16 {
                mul = bytes(|c| c.mul);
            }
            if F::BIAS != 0 {
                let bias = _mm256_set1_epi8(F::BIAS as i8);
                q = q.map(|v| _mm256_sub_epi8(v, bias));
                mag = q.map(|v| _mm256_abs_epi8(v));
            }
        }
        Transposed {
            q,
            mag,
            mul,
            d: lanes_of(ch, |c| c.d),
            m: lanes_of(ch, |c| c.m),
        }
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
    use crate::cpu::int8_gemm::{linear_on, runs, supports, Copy};
    use crate::cpu::quant::ALL;
    use crate::testutil::{random_blocks, values};

    #[test]
    fn lanes_give_the_bits_of_one_row_at_a_time_on_both_copies() {
        // a row alone takes `tiles`' one-row tiles; 3+ rows take `lanes`
        for copy in [Copy::Avx2, Copy::Vnni].into_iter().filter(|c| runs(*c)) {
            for ty in ALL.into_iter().filter(|t| supports(*t)) {
                let (n, k) = (19, 2 * ty.block().0.max(256));
                let w = random_blocks(ty, n, k, 11 + ty.ggml_id() as u64);
                for m in [MIN_ROWS, 8, 33] {
                    let x = values(m * k, m as u64);
                    let mut all = vec![0f32; m * n];
                    linear_on(copy, ty, &x, &w, &mut all, (m, n, k), 2);
                    for i in 0..m {
                        let mut one = vec![0f32; n];
                        linear_on(copy, ty, &x[i * k..][..k], &w, &mut one, (1, n, k), 1);
                        let same = one
                            .iter()
                            .zip(&all[i * n..])
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{copy:?} {ty:?} m={m} row {i}");
                    }
                }
            }
        }
    }

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
