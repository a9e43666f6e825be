//! The integer path's tiles, in two copies stamped from one macro (`copy!`): AVX2, whose
//! integer dot per 32 elements is `maddubs` (u8 x i8 pairs into i16) then `madd` (pairs into
//! i32), and AVX-512 VNNI on 256-bit registers, where one `dpbusd` forms the same dot (4
//! products into each i32 lane, no i16 step). No i16 sum can saturate (|q - BIAS| <= 128 or
//! q <= 31, |x| <= 127), so both copies compute the same integer dots exactly and then the
//! same float operations: they give the same bits.

use super::formats::{Chunk, Format, Mxfp4, Q4K, Q4_0, Q4_1, Q5_0, Q5_1, Q6K, Q8_0};
use super::lanes;
use super::{Geometry, QuantizedRows, QK};
use crate::cpu::quant::WeightType;
use std::arch::x86_64::*;

/// Software prefetch distance along a weight row, in bytes, into L2 (as `small_gemm`).
const PREFETCH: usize = 16384;

/// Where a tile's outputs go: x rows first.., weight rows `cols` (stored where `keep`).
struct Tile<const C: usize> {
    first: usize,
    cols: [usize; C],
    keep: [bool; C],
}

/// One block of x (QK floats at v) quantized into q (the header's rule): (d, sum of q).
/// Rounding is the conversion's round-half-even; |v * (1 / d)| <= 127 (to rounding), so the
/// saturating packs never clip.
/// SAFETY (caller): v holds QK floats, q QK bytes, and the CPU runs AVX2.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn quantize_block(v: *const f32, q: *mut i8) -> (f32, i32) {
    let mut a = [_mm256_setzero_ps(); 4];
    let mut top = _mm256_setzero_ps();
    for (i, x) in a.iter_mut().enumerate() {
        *x = _mm256_loadu_ps(v.add(8 * i));
        top = _mm256_max_ps(top, _mm256_andnot_ps(_mm256_set1_ps(-0.0), *x));
    }
    let four = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps::<1>(top));
    let two = _mm_max_ps(four, _mm_movehl_ps(four, four));
    let amax = _mm_cvtss_f32(_mm_max_ss(two, _mm_movehdup_ps(two)));
    let d = amax / 127.0;
    if d < f32::MIN_POSITIVE {
        std::ptr::write_bytes(q, 0, QK);
        return (0.0, 0);
    }
    let id = _mm256_set1_ps(1.0 / d);
    let mut n = [_mm256_setzero_si256(); 4];
    for i in 0..4 {
        n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(a[i], id));
    }
    let bytes = _mm256_packs_epi16(
        _mm256_packs_epi32(n[0], n[1]),
        _mm256_packs_epi32(n[2], n[3]),
    );
    // packs work within 128-bit lanes: the 4-byte groups hold elements 0-3, 8-11, 16-19,
    // 24-27, 4-7, 12-15, 20-23, 28-31
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256(q as *mut __m256i, _mm256_permutevar8x32_epi32(bytes, order));
    let total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
    let half = _mm_add_epi32(
        _mm256_castsi256_si128(total),
        _mm256_extracti128_si256::<1>(total),
    );
    let pair = _mm_add_epi32(half, _mm_unpackhi_epi64(half, half));
    let sum = _mm_cvtsi128_si32(_mm_add_epi32(pair, _mm_shuffle_epi32::<1>(pair)));
    (d, sum)
}

/// Lane j = the sum of v[j]'s 8 lanes (i32 adds of integer dots: exact).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn hsum8(v: [__m256i; 8]) -> __m256i {
    let a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    let b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    // a: lanes 0..4 the low 128-bit halves' sums of v0..v3, lanes 4..8 the high halves'
    let low = _mm256_permute2x128_si256::<0x20>(a, b);
    let high = _mm256_permute2x128_si256::<0x31>(a, b);
    _mm256_add_epi32(low, high)
}

/// Lane l = `f(chunk l % C)` (a weight row's value in each of its outputs' lanes).
#[inline(always)]
unsafe fn by_col<const C: usize>(ch: &[Chunk; C], f: fn(&Chunk) -> f32) -> __m256 {
    let mut v = [0f32; 8];
    for (l, e) in v.iter_mut().enumerate() {
        *e = f(&ch[l % C]);
    }
    _mm256_setr_ps(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7])
}

/// Lane l = `v[at + l / C]` (an x row's value in each of its outputs' lanes); v has 4
/// readable values from `at`.
#[inline(always)]
unsafe fn by_row<const C: usize>(v: &[f32], at: usize) -> __m256 {
    let mut idx = [0i32; 8];
    for (l, e) in idx.iter_mut().enumerate() {
        *e = (l / C) as i32;
    }
    let four = _mm256_castps128_ps256(_mm_loadu_ps(v.as_ptr().add(at)));
    _mm256_permutevar8x32_ps(four, _mm256_loadu_si256(idx.as_ptr() as *const __m256i))
}

macro_rules! copy {
    ($name:ident, $features:literal, $vnni:expr) => {
        pub(super) mod $name {
            use super::*;

            /// Output columns `cols` of every row of x for weights of type `ty`.
            /// SAFETY (caller): w holds n rows of g.row_bytes, out [m, n], xq quantizes x
            /// [m, k], cols lies in 0..n, and the CPU runs this copy's features.
            pub(in crate::cpu::int8_gemm) unsafe fn columns(
                ty: WeightType,
                xq: &QuantizedRows,
                w: *const u8,
                out: *mut f32,
                g: &Geometry,
                cols: std::ops::Range<usize>,
            ) {
                match ty {
                    WeightType::Q4_0 => by_rows::<Q4_0>(xq, w, out, g, cols),
                    WeightType::Q4_1 => by_rows::<Q4_1>(xq, w, out, g, cols),
                    WeightType::Q5_0 => by_rows::<Q5_0>(xq, w, out, g, cols),
                    WeightType::Q5_1 => by_rows::<Q5_1>(xq, w, out, g, cols),
                    WeightType::Q8_0 => by_rows::<Q8_0>(xq, w, out, g, cols),
                    WeightType::Q4K => by_rows::<Q4K>(xq, w, out, g, cols),
                    WeightType::Q6K => by_rows::<Q6K>(xq, w, out, g, cols),
                    WeightType::Mxfp4 => by_rows::<Mxfp4>(xq, w, out, g, cols),
                    _ => unreachable!("int8_gemm: {ty:?} (checked by `supports`)"),
                }
            }

            /// Tiles of 8 outputs: 8 weight rows for 1 x row, 4 for 2 (R * C = 8); from
            /// `lanes::MIN_ROWS` x rows on, `lanes`' one output per lane.
            #[target_feature(enable = $features)]
            unsafe fn by_rows<F: Format>(
                xq: &QuantizedRows,
                w: *const u8,
                out: *mut f32,
                g: &Geometry,
                cols: std::ops::Range<usize>,
            ) {
                if g.mnk.0 >= lanes::MIN_ROWS {
                    return lanes::$name::columns::<F>(xq, w, out, g, cols);
                }
                match g.mnk.0 {
                    1 => spread::<F, 8>(xq, w, out, g, cols),
                    _ => spread::<F, 4>(xq, w, out, g, cols),
                }
            }

            /// C weight rows at a time, from C equal parts of `cols` (a, a + s, a + 2 s, ...:
            /// separate streams, as `small_gemm::pair_rows` says why), against every group of
            /// 8 / C x rows. A row past the end of `cols` is computed from a valid row and not
            /// stored.
            #[inline(always)]
            unsafe fn spread<F: Format, const C: usize>(
                xq: &QuantizedRows,
                w: *const u8,
                out: *mut f32,
                g: &Geometry,
                cols: std::ops::Range<usize>,
            ) {
                let ((m, _, _), rb) = (g.mnk, g.row_bytes);
                let step = (cols.end - cols.start).div_ceil(C);
                for a in cols.start..cols.start + step {
                    let ids: [usize; C] = std::array::from_fn(|c| a + c * step);
                    let ws = ids.map(|j| w.add(j.min(cols.end - 1) * rb));
                    let keep = ids.map(|j| j < cols.end);
                    let mut i = 0;
                    while i < m {
                        let r = (8 / C).min(m - i);
                        let at = Tile {
                            first: i,
                            cols: ids,
                            keep,
                        };
                        match r {
                            2 => tile::<F, 2, C>(xq, &at, ws, out, g),
                            _ => tile::<F, 1, C>(xq, &at, ws, out, g),
                        }
                        i += r;
                    }
                }
            }

            /// The integer dots of R x rows with C weight chunks at t, output r * C + c in
            /// dots[r * C + c] (8 i32 lanes summing to it).
            #[inline(always)]
            unsafe fn dots<F: Format, const R: usize, const C: usize>(
                xq: &QuantizedRows,
                at: &Tile<C>,
                ch: &[Chunk; C],
                t: usize,
            ) -> [__m256i; 8] {
                let (m, k) = (xq.m, xq.k);
                let (mut signed, mut mag) =
                    ([_mm256_setzero_si256(); C], [_mm256_setzero_si256(); C]);
                for c in 0..C {
                    signed[c] = _mm256_sub_epi8(ch[c].q, _mm256_set1_epi8(F::BIAS as i8));
                    mag[c] = _mm256_abs_epi8(signed[c]);
                }
                let mut out = [_mm256_setzero_si256(); 8];
                for r in 0..R {
                    let row = at.first + r;
                    let xv = _mm256_loadu_si256(xq.qs.as_ptr().add(row * k + t) as *const __m256i);
                    // dpbusd: sum (q - BIAS) x = sum q x - BIAS sum(x), the second term spread
                    // over the 8 lanes
                    let sum = *xq.sums.get_unchecked(t / QK * m + row);
                    let init = _mm256_set1_epi32(-sum * (F::BIAS / 8));
                    for c in 0..C {
                        out[r * C + c] = if $vnni && !F::SCALED16 {
                            _mm256_dpbusd_epi32(init, ch[c].q, xv)
                        } else if F::BIAS != 0 {
                            let prod =
                                _mm256_maddubs_epi16(mag[c], _mm256_sign_epi8(xv, signed[c]));
                            _mm256_madd_epi16(prod, ch[c].mul)
                        } else {
                            _mm256_madd_epi16(_mm256_maddubs_epi16(ch[c].q, xv), ch[c].mul)
                        };
                    }
                }
                out
            }

            /// out[first + r, cols[c]] for R x rows and C weight rows (R * C <= 8), output
            /// r * C + c in lane r * C + c: per chunk of 32, each output's integer dot
            /// (`dots`, lanes summed by `hsum8`), then one multiply-add of the lane's dw * dx,
            /// and for affine formats one of m * dx * sum(qx).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn tile<F: Format, const R: usize, const C: usize>(
                xq: &QuantizedRows,
                at: &Tile<C>,
                w: [*const u8; C],
                out: *mut f32,
                g: &Geometry,
            ) {
                let (m, n, k) = g.mnk;
                let mut acc = _mm256_setzero_ps();
                let mut t = 0;
                let mut shared = [F::shared(w[0], 0); C];
                let mut ch = [Chunk::zero(); C];
                while t < k {
                    for c in 0..C {
                        if t % F::BLOCK.0 == 0 {
                            shared[c] = F::shared(w[c], t);
                        }
                        if t % 64 == 0 {
                            let ahead = t / F::BLOCK.0 * F::BLOCK.1 + PREFETCH;
                            _mm_prefetch::<_MM_HINT_T1>(w[c].wrapping_add(ahead) as *const i8);
                        }
                        ch[c] = F::chunk(w[c], t, &shared[c]);
                    }
                    let sum = _mm256_cvtepi32_ps(hsum8(dots::<F, R, C>(xq, at, &ch, t)));
                    let scales = t / QK * m + at.first; // this block's x scales, by row
                    let scale = _mm256_mul_ps(by_col(&ch, |c| c.d), by_row::<C>(&xq.d, scales));
                    acc = _mm256_fmadd_ps(sum, scale, acc);
                    if F::OFFSET {
                        acc =
                            _mm256_fmadd_ps(by_col(&ch, |c| c.m), by_row::<C>(&xq.ds, scales), acc);
                    }
                    t += QK;
                }
                let mut lanes = [0f32; 8];
                _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
                for r in 0..R {
                    for c in (0..C).filter(|&c| at.keep[c]) {
                        *out.add((at.first + r) * n + at.cols[c]) = lanes[r * C + c];
                    }
                }
            }
        }
    };
}

copy!(avx2, "avx2,fma,f16c", false);
copy!(vnni, "avx2,fma,f16c,avx512vnni,avx512vl", true);
