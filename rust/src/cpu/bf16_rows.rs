//! RMSNorm and RoPE over bfloat16 buffers (as u16 bits) for a bfloat16 CPU forward pass,
//! split over torch's OpenMP threads.
//!
//! Why native: torch runs a bfloat16 RMSNorm as several float32 passes, each with a fresh
//! multi-megabyte buffer (measured on a 2048 x 576 prefill step: `F.rms_norm` in float32 and
//! the weight's `mul_`, 1.3-4.8 ms; this one pass 0.3-0.45 ms), and RoPE as five ops (cat,
//! neg, two products, a sum: ~1.2 ms for q and k of that step). A model runs two norms and
//! two rotations per layer. (A native silu(gate) * up measured no faster than torch's
//! in-place silu_ then mul_.)
//!
//! Values are transformers' in bfloat16, rounded where its ops round (to nearest even):
//!   rms_norm: out = bf16(w * bf16(x / sqrt(mean(x^2) + eps))), the mean in float32;
//!   rotary:   out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), torch's bits exactly
//!             (a product of two bfloat16 values is exact in float32).

use crate::cpu::decoder_layer::sum_of_squares;
use crate::cpu::omp;

/// Rows per task of a call: a task is a few microseconds of work at least.
const TASK_ROWS: usize = 16;

/// The float32 value of bfloat16 bits (exact).
#[inline(always)]
pub fn to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// `f` rounded to the nearest bfloat16 (ties to even); NaN stays a (quiet) NaN.
#[inline(always)]
pub fn to_bf16(f: f32) -> u16 {
    let bits = f.to_bits();
    let rounded = (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
    let quiet = ((bits >> 16) as u16) | 0x40;
    let nan = (f.is_nan() as u16).wrapping_neg(); // all ones for NaN: a select, no branch
    (rounded & !nan) | (quiet & nan)
}

/// out[r] = RMSNorm of x[r] times `weight` (module doc), for each row of `weight.len()` values,
/// over up to `threads` of torch's threads. x and out hold the same whole number of rows.
pub fn rms_norm(x: &[u16], weight: &[u16], eps: f32, out: &mut [u16], threads: usize) {
    let h = weight.len();
    assert!(
        h > 0 && x.len() == out.len() && x.len().is_multiple_of(h),
        "rms_norm: row sizes"
    );
    let rows = x.len() / h;
    let out_addr = out.as_mut_ptr() as usize;
    omp::run_tasks(rows.div_ceil(TASK_ROWS), threads, &|task| {
        let first = task * TASK_ROWS;
        let n = TASK_ROWS.min(rows - first) * h;
        // SAFETY: tasks cover disjoint row ranges of `out`, which outlives `run_tasks`.
        let dst =
            unsafe { std::slice::from_raw_parts_mut((out_addr as *mut u16).add(first * h), n) };
        norm_rows(&x[first * h..][..n], weight, eps, dst);
    });
}

/// RoPE ("rotate half") of x [tokens, heads, d] by cos, sin [tokens, d] into out (module
/// doc), over up to `threads` of torch's threads.
pub fn rotary(
    x: &[u16],
    (cos, sin): (&[u16], &[u16]),
    out: &mut [u16],
    (heads, d): (usize, usize),
    threads: usize,
) {
    assert!(
        d > 0 && d.is_multiple_of(2) && sin.len() == cos.len(),
        "rotary: sizes"
    );
    let tokens = cos.len() / d;
    assert!(
        cos.len() == tokens * d && x.len() == tokens * heads * d && out.len() == x.len(),
        "rotary: sizes"
    );
    let row = heads * d;
    let out_addr = out.as_mut_ptr() as usize;
    omp::run_tasks(tokens.div_ceil(TASK_ROWS), threads, &|task| {
        let first = task * TASK_ROWS;
        let n = TASK_ROWS.min(tokens - first);
        // SAFETY: tasks cover disjoint token ranges of `out`, which outlives `run_tasks`.
        let dst = unsafe {
            std::slice::from_raw_parts_mut((out_addr as *mut u16).add(first * row), n * row)
        };
        let tables = (&cos[first * d..][..n * d], &sin[first * d..][..n * d]);
        rotate_tokens(&x[first * row..][..n * row], tables, dst, d);
    });
}

fn rotate_tokens(x: &[u16], tables: (&[u16], &[u16]), out: &mut [u16], d: usize) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
    {
        // SAFETY: the CPU runs AVX-512 F and BW (detected).
        return unsafe { rotate_tokens_avx512(x, tables, out, d) };
    }
    rotate_tokens_scalar(x, tables, out, d)
}

/// The scalar code compiled for AVX-512 (vectorised by the compiler, rounding as it does).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn rotate_tokens_avx512(x: &[u16], tables: (&[u16], &[u16]), out: &mut [u16], d: usize) {
    rotate_tokens_scalar(x, tables, out, d)
}

/// Each token's heads (rows of d values in x and out) by that token's d cos and sin values.
#[inline(always)]
fn rotate_tokens_scalar(x: &[u16], (cos, sin): (&[u16], &[u16]), out: &mut [u16], d: usize) {
    let half = d / 2;
    let row = x.len() / (cos.len() / d).max(1);
    let tokens = x.chunks_exact(row).zip(out.chunks_exact_mut(row));
    for ((src, dst), (c, s)) in tokens.zip(cos.chunks_exact(d).zip(sin.chunks_exact(d))) {
        let ((c_lo, c_hi), (s_lo, s_hi)) = (c.split_at(half), s.split_at(half));
        for (head, o) in src.chunks_exact(d).zip(dst.chunks_exact_mut(d)) {
            let (lo, hi) = head.split_at(half);
            let (o_lo, o_hi) = o.split_at_mut(half);
            // rotate_half: [-hi, lo]; zipped slices of one length (no bounds checks: vectorises)
            let halves = lo.iter().zip(hi).zip(o_lo.iter_mut().zip(o_hi));
            let tables = c_lo.iter().zip(c_hi).zip(s_lo.iter().zip(s_hi));
            for (((&l, &h), (ol, oh)), ((&cl, &ch), (&sl, &sh))) in halves.zip(tables) {
                *ol = rope_value(l, cl, -to_f32(h), sl);
                *oh = rope_value(h, ch, to_f32(l), sh);
            }
        }
    }
}

#[inline(always)]
fn rope_value(x: u16, cos: u16, rotated: f32, sin: u16) -> u16 {
    let a = to_f32(to_bf16(to_f32(x) * to_f32(cos)));
    let b = to_f32(to_bf16(rotated * to_f32(sin)));
    to_bf16(a + b)
}

fn norm_rows(x: &[u16], weight: &[u16], eps: f32, out: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
    {
        // SAFETY: the CPU runs AVX-512 F and BW (detected).
        return unsafe { norm_rows_avx512(x, weight, eps, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU runs AVX2 (detected).
        return unsafe { norm_rows_avx2(x, weight, eps, out) };
    }
    norm_rows_scalar(x, weight, eps, out)
}

/// The scalar code compiled for AVX-512 (vectorised by the compiler; Rust never fuses a
/// multiply and an add on its own, so the lanes round as the scalar code does).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn norm_rows_avx512(x: &[u16], weight: &[u16], eps: f32, out: &mut [u16]) {
    norm_rows_scalar(x, weight, eps, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn norm_rows_avx2(x: &[u16], weight: &[u16], eps: f32, out: &mut [u16]) {
    norm_rows_scalar(x, weight, eps, out)
}

#[inline(always)]
fn norm_rows_scalar(x: &[u16], weight: &[u16], eps: f32, out: &mut [u16]) {
    let h = weight.len();
    for (row, dst) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
        let inv = 1.0 / (sum_of_squares(row, to_f32) / h as f32 + eps).sqrt();
        dst.iter_mut()
            .zip(row.iter().zip(weight))
            .for_each(|(o, (&v, &w))| {
                *o = to_bf16(to_f32(w) * to_f32(to_bf16(to_f32(v) * inv)));
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(values: &[f32]) -> Vec<u16> {
        values.iter().map(|&v| to_bf16(v)).collect()
    }

    #[test]
    fn rounding_is_to_nearest_even() {
        assert_eq!(to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even (1.0)
        assert_eq!(to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(to_bf16(f32::INFINITY), 0x7f80);
        assert!(to_f32(to_bf16(f32::NAN)).is_nan());
        assert!(to_f32(to_bf16(f32::from_bits(0x7f80_0001))).is_nan());
        assert_eq!(to_f32(0x3fc0), 1.5);
    }

    #[test]
    fn rms_norm_matches_float64() {
        let h = 37; // not a multiple of the lanes
        let x: Vec<f32> = (0..3 * h)
            .map(|i| ((i * 7919) % 23) as f32 / 5.0 - 2.0)
            .collect();
        let w: Vec<f32> = (0..h).map(|i| 0.5 + i as f32 / h as f32).collect();
        let (xb, wb) = (bits(&x), bits(&w));
        let mut out = vec![0u16; xb.len()];
        rms_norm(&xb, &wb, 1e-5, &mut out, 2);
        for (r, row) in xb.chunks(h).enumerate() {
            let ms: f64 = row.iter().map(|&v| (to_f32(v) as f64).powi(2)).sum::<f64>() / h as f64;
            for i in 0..h {
                let normed = to_f32(to_bf16((to_f32(row[i]) as f64 / (ms + 1e-5).sqrt()) as f32));
                let want = to_bf16(normed * to_f32(wb[i]));
                assert_eq!(out[r * h + i], want, "row {r} value {i}");
            }
        }
    }

    #[test]
    fn rotary_rounds_each_op_as_torch() {
        let (tokens, heads, d) = (37, 3, 8);
        let x = bits(
            &(0..tokens * heads * d)
                .map(|i| ((i * 37) % 29) as f32 / 7.0 - 2.0)
                .collect::<Vec<_>>(),
        );
        let cos = bits(
            &(0..tokens * d)
                .map(|i| (i as f32 / 11.0).cos())
                .collect::<Vec<_>>(),
        );
        let sin = bits(
            &(0..tokens * d)
                .map(|i| (i as f32 / 11.0).sin())
                .collect::<Vec<_>>(),
        );
        let mut out = vec![0u16; x.len()];
        rotary(&x, (&cos, &sin), &mut out, (heads, d), 2);
        let round = |v: f32| to_f32(to_bf16(v));
        for t in 0..tokens {
            for h in 0..heads {
                for i in 0..d {
                    let at = |j: usize| to_f32(x[(t * heads + h) * d + j]);
                    let rot = if i < d / 2 {
                        -at(i + d / 2)
                    } else {
                        at(i - d / 2)
                    };
                    let (c, s) = (to_f32(cos[t * d + i]), to_f32(sin[t * d + i]));
                    let want = to_bf16(round(at(i) * c) + round(rot * s));
                    assert_eq!(
                        out[(t * heads + h) * d + i],
                        want,
                        "token {t} head {h} value {i}"
                    );
                }
            }
        }
    }
}
