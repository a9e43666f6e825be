//! The GGUF block formats as the integer path reads them: 32 consecutive elements of a weight
//! row at a time (`Chunk`), their small integers in bytes and their scales as floats.

use std::arch::x86_64::*;

/// 32 consecutive elements of a weight row: value = d * mul * (q - BIAS) + m, where q are
/// unsigned bytes and `mul` holds i16 multipliers per element pair (1, or Q6_K's scale of each
/// 16 elements).
#[derive(Clone, Copy)]
pub(super) struct Chunk {
    pub q: __m256i,
    pub mul: __m256i,
    pub d: f32,
    pub m: f32,
}

impl Chunk {
    /// A placeholder, overwritten before use.
    #[inline(always)]
    pub unsafe fn zero() -> Self {
        Chunk::of(_mm256_setzero_si256(), 0.0, 0.0)
    }

    /// A chunk of one scale d and offset m.
    #[inline(always)]
    unsafe fn of(q: __m256i, d: f32, m: f32) -> Self {
        Chunk {
            q,
            mul: _mm256_set1_epi16(1),
            d,
            m,
        }
    }
}

/// A block format as chunks of 32 elements (a whole block, or a K-quant's sub-block).
pub(super) trait Format {
    /// What q is offset by: the symmetric formats' q - BIAS are signed (|q - BIAS| <= 128);
    /// 0 for the affine ones (q <= 31, the offset in m).
    const BIAS: i32;
    /// `mul` is not all ones (Q6_K).
    const SCALED16: bool = false;
    /// m is not 0.
    const OFFSET: bool;
    /// (elements, bytes) of a block.
    const BLOCK: (usize, usize);
    /// What the chunks of one block share, decoded once per block (K-quants' scales).
    type Shared: Copy;
    /// The shared part of the block holding element t (t a multiple of the block).
    ///
    /// # Safety
    /// As `chunk`.
    unsafe fn shared(row: *const u8, t: usize) -> Self::Shared;
    /// Elements t..t + 32 of `row` (t a multiple of 32), `sh` its block's `shared`.
    ///
    /// # Safety
    /// `row` holds at least t + 32 elements of the format and the CPU runs AVX2, FMA, F16C.
    unsafe fn chunk(row: *const u8, t: usize, sh: &Self::Shared) -> Chunk;
}

/// `Format`'s block items of a format whose chunks are whole blocks (nothing shared).
macro_rules! whole_blocks {
    () => {
        type Shared = ();
        #[inline(always)]
        unsafe fn shared(_: *const u8, _: usize) {}
    };
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn half(p: *const u8) -> f32 {
    let bits = std::ptr::read_unaligned(p as *const u16);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// 16 bytes at p as 32 nibbles: low nibbles (elements 0..16) then high (16..32).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles16(p: *const u8) -> __m256i {
    let v = _mm_loadu_si128(p as *const __m128i);
    let both = _mm256_set_m128i(_mm_srli_epi16::<4>(v), v);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0f))
}

/// Byte i = 16 where bit i of the u32 at p is set, else 0 (Q5's fifth bits).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fifth_bits(p: *const u8) -> __m256i {
    let bits = _mm256_set1_epi32(std::ptr::read_unaligned(p as *const u32) as i32);
    // byte i takes byte i / 8 of the word (shuffles stay in 128-bit lanes, each holding the
    // word 4 times), then tests bit i % 8 of it
    let which = _mm256_setr_epi64x(
        0,
        0x0101_0101_0101_0101,
        0x0202_0202_0202_0202,
        0x0303_0303_0303_0303,
    );
    let mask = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(
        _mm256_and_si256(_mm256_shuffle_epi8(bits, which), mask),
        mask,
    );
    _mm256_and_si256(set, _mm256_set1_epi8(16))
}

/// d * (q - 8); block: d, qs[16].
pub(super) struct Q4_0;
impl Format for Q4_0 {
    const BIAS: i32 = 8;
    const OFFSET: bool = false;
    const BLOCK: (usize, usize) = (32, 18);
    whole_blocks!();
    #[inline(always)]
    unsafe fn chunk(row: *const u8, t: usize, _: &()) -> Chunk {
        let b = row.add(t / 32 * 18);
        Chunk::of(nibbles16(b.add(2)), half(b), 0.0)
    }
}

/// d * q + m; block: d, m, qs[16].
pub(super) struct Q4_1;
impl Format for Q4_1 {
    const BIAS: i32 = 0;
    const OFFSET: bool = true;
    const BLOCK: (usize, usize) = (32, 20);
    whole_blocks!();
    #[inline(always)]
    unsafe fn chunk(row: *const u8, t: usize, _: &()) -> Chunk {
        let b = row.add(t / 32 * 20);
        Chunk::of(nibbles16(b.add(4)), half(b), half(b.add(2)))
    }
}

/// d * (q - 16); block: d, qh (u32 of fifth bits), qs[16].
pub(super) struct Q5_0;
impl Format for Q5_0 {
    const BIAS: i32 = 16;
    const OFFSET: bool = false;
    const BLOCK: (usize, usize) = (32, 22);
    whole_blocks!();
    #[inline(always)]
    unsafe fn chunk(row: *const u8, t: usize, _: &()) -> Chunk {
        let b = row.add(t / 32 * 22);
        let q = _mm256_or_si256(nibbles16(b.add(6)), fifth_bits(b.add(2)));
        Chunk::of(q, half(b), 0.0)
    }
}

/// d * q + m; block: d, m, qh, qs[16].
pub(super) struct Q5_1;
impl Format for Q5_1 {
    const BIAS: i32 = 0;
    const OFFSET: bool = true;
    const BLOCK: (usize, usize) = (32, 24);
    whole_blocks!();
    #[inline(always)]
    unsafe fn chunk(row: *const u8, t: usize, _: &()) -> Chunk {
        let b = row.add(t / 32 * 24);
        let q = _mm256_or_si256(nibbles16(b.add(8)), fifth_bits(b.add(4)));
        Chunk::of(q, half(b), half(b.add(2)))
    }
}

/// d * q for signed bytes q, read as q + 128; block: d, qs[32].
pub(super) struct Q8_0;
impl Format for Q8_0 {
    const BIAS: i32 = 128;
    const OFFSET: bool = false;
    const BLOCK: (usize, usize) = (32, 34);
    whole_blocks!();
    #[inline(always)]
    unsafe fn chunk(row: *const u8, t: usize, _: &()) -> Chunk {
        let b = row.add(t / 32 * 34);
        let q = _mm256_loadu_si256(b.add(2) as *const __m256i);
        Chunk::of(_mm256_xor_si256(q, _mm256_set1_epi8(-128)), half(b), 0.0)
    }
}

/// Sub-block s (32 elements) of a 256-element block: (d * sc) * q - (dmin * mn); block: d,
/// dmin, scales[12], qs[128] (sub-block s: nibble s % 2 of qs[32 * (s / 2)..][..32]).
pub(super) struct Q4K;
impl Format for Q4K {
    const BIAS: i32 = 0;
    const OFFSET: bool = true;
    const BLOCK: (usize, usize) = (256, 144);
    /// Per sub-block: (d * sc, -(dmin * mn)).
    type Shared = [(f32, f32); 8];
    #[inline(always)]
    unsafe fn shared(row: *const u8, t: usize) -> Self::Shared {
        let b = row.add(t / 256 * 144);
        let (d, dmin) = (half(b), half(b.add(2)));
        let packed = std::slice::from_raw_parts(b.add(4), 12);
        let mut out = [(0f32, 0f32); 8];
        for (s, o) in out.iter_mut().enumerate() {
            let (sc, mn) = crate::cpu::quant::q4k_scale_min(packed, s);
            *o = (d * sc as f32, -(dmin * mn as f32));
        }
        out
    }
    #[inline(always)]
    unsafe fn chunk(row: *const u8, t: usize, sh: &Self::Shared) -> Chunk {
        let b = row.add(t / 256 * 144);
        let s = t % 256 / 32;
        let qs = _mm256_loadu_si256(b.add(16 + 32 * (s / 2)) as *const __m256i);
        let qs = _mm256_srl_epi16(qs, _mm_cvtsi32_si128(4 * (s % 2) as i32));
        let q = _mm256_and_si256(qs, _mm256_set1_epi8(0x0f));
        Chunk::of(q, sh[s].0, sh[s].1)
    }
}

/// Elements e..e + 32 of a 256-element block: d * scales[e / 16] * (q - 32), q six bits from
/// ql's nibble and qh's bit pair; block: ql[128], qh[64], scales[16] (i8), d. The scale of
/// each 16 elements is an integer multiplier (`mul`).
pub(super) struct Q6K;
impl Format for Q6K {
    const BIAS: i32 = 32;
    const SCALED16: bool = true;
    const OFFSET: bool = false;
    const BLOCK: (usize, usize) = (256, 210);
    /// The block's d.
    type Shared = f32;
    #[inline(always)]
    unsafe fn shared(row: *const u8, t: usize) -> f32 {
        half(row.add(t / 256 * 210 + 208))
    }
    #[inline(always)]
    unsafe fn chunk(row: *const u8, t: usize, d: &f32) -> Chunk {
        let b = row.add(t / 256 * 210);
        let (e, a, r) = (t % 256, t % 256 / 128, t % 128);
        let ql = _mm256_loadu_si256(b.add(64 * a + r % 64) as *const __m256i);
        let ql = _mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (r / 64) as i32));
        let qh = _mm256_loadu_si256(b.add(128 + 32 * a) as *const __m256i);
        let qh = _mm256_srl_epi16(qh, _mm_cvtsi32_si128((r / 32 * 2) as i32));
        let q = _mm256_or_si256(
            _mm256_and_si256(ql, _mm256_set1_epi8(0x0f)),
            _mm256_slli_epi16::<4>(_mm256_and_si256(qh, _mm256_set1_epi8(3))),
        );
        let (lo, hi) = (*b.add(192 + e / 16) as i8, *b.add(193 + e / 16) as i8);
        let mul = _mm256_set_m128i(_mm_set1_epi16(hi as i16), _mm_set1_epi16(lo as i16));
        Chunk {
            q,
            mul,
            d: *d,
            m: 0.0,
        }
    }
}

/// e8m0_half(e) * value(code), MXFP4's doubled integer values read as value + 128 (as Q8_0's
/// bytes); block: e (E8M0), qs[16] (element j: nibble j / 16 of qs[j % 16]).
pub(super) struct Mxfp4;
impl Format for Mxfp4 {
    const BIAS: i32 = 128;
    const OFFSET: bool = false;
    const BLOCK: (usize, usize) = (32, 17);
    whole_blocks!();
    #[inline(always)]
    unsafe fn chunk(row: *const u8, t: usize, _: &()) -> Chunk {
        let b = row.add(t / 32 * 17);
        let (lo, hi) = crate::cpu::quant::mxfp4_values(b.add(1));
        let q = _mm256_xor_si256(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(-128));
        Chunk::of(q, crate::cpu::quant::e8m0_half(*b), 0.0)
    }
}
