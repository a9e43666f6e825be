//! Weight formats the CPU kernels read: float32, bfloat16 and fp16 bits, and GGUF's quantized blocks
//! (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K, MXFP4), expanded in registers to the exact
//! float32 values the `gguf` package's dequantizer produces.
//!
//! Why: a CPU decode step streams every weight once; a float32 copy of a Q4_1 checkpoint is
//! ~7x the bytes of its blocks. Each format's value is a product of an fp16 scale, small
//! integers and an optional fp16 offset. Every product below is exact in float32 (fp16 has 11
//! significant bits, the integers at most 7 + 6), so the only rounding is the final addition
//! or subtraction of the offset, which a fused multiply-add performs once, as numpy's separate
//! multiply-then-add does. Where the reference forms a product in two steps (Q4_K's and Q6_K's
//! `d * scale`, then `* q`), the lanes do the same two steps, so equality does not even rest on
//! the exactness argument. MXFP4's value is a power of two (its E8M0 scale halved, subnormal for
//! the exponent bytes 0 and 1) times an integer of at most 12: exact too, up to an overflow to
//! infinity for exponent bytes of 253 and more, which the reference's float32 product makes
//! alike. The GEMM (`small_gemm`) then computes the same sums from the same
//! values: results equal the dequantized float32 model's bit for bit.
//!
//! Layout: a matrix [n, k] is n rows of `row_bytes(k)` bytes each, a row being k / QK blocks
//! in GGUF's order (the `gguf` package's `quants.py` documents the block structs). The loaders
//! take 16 (AVX-512) or 8 (AVX2) consecutive elements starting at an element index t that is a
//! multiple of the lane count; a block's 16-element groups each read 16 consecutive bytes of
//! its nibble or byte array and one scale, which is what makes the expansion a few
//! instructions.

/// A weight matrix's element format, numbered as GGML's `ggml_type` (the `gguf` package's
/// `GGMLQuantizationType`), so the Python side passes the GGUF tensor type as is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q6K,
    Mxfp4,
}

pub const ALL: [WeightType; 11] = [
    WeightType::F32,
    WeightType::F16,
    WeightType::Bf16,
    WeightType::Q4_0,
    WeightType::Q4_1,
    WeightType::Q5_0,
    WeightType::Q5_1,
    WeightType::Q8_0,
    WeightType::Q4K,
    WeightType::Q6K,
    WeightType::Mxfp4,
];

impl WeightType {
    /// GGML's type number.
    pub fn ggml_id(self) -> u32 {
        match self {
            WeightType::F32 => 0,
            WeightType::F16 => 1,
            WeightType::Q4_0 => 2,
            WeightType::Q4_1 => 3,
            WeightType::Q5_0 => 6,
            WeightType::Q5_1 => 7,
            WeightType::Q8_0 => 8,
            WeightType::Q4K => 12,
            WeightType::Q6K => 14,
            WeightType::Bf16 => 30,
            WeightType::Mxfp4 => 39,
        }
    }

    /// The format of GGML type number `id`, None for one the kernels do not read.
    pub fn from_ggml(id: u32) -> Option<Self> {
        ALL.into_iter().find(|t| t.ggml_id() == id)
    }

    /// (elements, bytes) of one block; float formats are blocks of one element.
    pub fn block(self) -> (usize, usize) {
        match self {
            WeightType::F32 => (1, 4),
            WeightType::F16 | WeightType::Bf16 => (1, 2),
            WeightType::Q4_0 => (32, 18),
            WeightType::Q4_1 => (32, 20),
            WeightType::Q5_0 => (32, 22),
            WeightType::Q5_1 => (32, 24),
            WeightType::Q8_0 => (32, 34),
            WeightType::Q4K => (256, 144),
            WeightType::Q6K => (256, 210),
            WeightType::Mxfp4 => (32, 17),
        }
    }

    /// Whether the format is one of GGUF's block formats (k a multiple of its block).
    pub fn is_quantized(self) -> bool {
        self.block().0 > 1
    }

    /// Bytes of a row of k elements; None when k is not a whole number of blocks (or 0).
    pub fn row_bytes(self, k: usize) -> Option<usize> {
        let (elems, bytes) = self.block();
        (k > 0 && k.is_multiple_of(elems)).then(|| k / elems * bytes)
    }
}

/// An IEEE half's value (exact: every fp16 value is a float32 value).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let frac = (h & 0x3ff) as u32;
    let bits = match (exp, frac) {
        (0, 0) => sign,
        (0, _) => {
            // subnormal: frac * 2^-24, normalised
            let shift = frac.leading_zeros() - 21; // brings the top bit to bit 10
            let frac = (frac << shift) & 0x3ff;
            sign | ((113 - shift) << 23) | (frac << 13)
        }
        (31, _) => sign | 0x7f80_0000 | (frac << 13),
        _ => sign | ((exp + 112) << 23) | (frac << 13),
    };
    f32::from_bits(bits)
}

/// MXFP4's E2M1 codes as doubled integers (GGML's table): code c is `MXFP4_VALUES[c] / 2`
/// times 2^(e - 127); the halving goes into the scale (`e8m0_half`). Code 8 is +0.
pub const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half the value 2^(e - 127) of an E8M0 exponent byte, as GGML's `e8m0_to_fp32_half` forms its
/// bits: 2^(e - 128), subnormal for e < 2 (2^-128, 2^-127); never infinite (e = 255: 2^127).
#[inline]
pub fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (e as u32 - 1) << 23
    };
    f32::from_bits(bits)
}

fn half(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Q4_K's 6-bit (scale, min) of sub-block `s` (0..8) from its 12 packed bytes.
#[inline]
pub fn q4k_scale_min(s12: &[u8], s: usize) -> (u8, u8) {
    if s < 4 {
        (s12[s] & 63, s12[4 + s] & 63)
    } else {
        let i = s - 4;
        let sc = (s12[8 + i] & 0x0f) | ((s12[i] >> 2) & 0x30);
        let mn = (s12[8 + i] >> 4) | ((s12[4 + i] >> 2) & 0x30);
        (sc, mn)
    }
}

/// The reference expansion of one row (`row_bytes(out.len())` bytes) into float32, written as
/// the `gguf` package's numpy dequantizer computes each element (a scalar mirror of it, used
/// by the tests as the lanes' reference). Panics on a size mismatch.
pub fn dequantize_row(ty: WeightType, row: &[u8], out: &mut [f32]) {
    let k = out.len();
    assert_eq!(
        Some(row.len()),
        ty.row_bytes(k),
        "{ty:?} row of {k} elements"
    );
    let (elems, bytes) = ty.block();
    for (b, o) in row.chunks_exact(bytes).zip(out.chunks_exact_mut(elems)) {
        for (e, v) in o.iter_mut().enumerate() {
            *v = element(ty, b, e);
        }
    }
}

/// Element e of block b (see `dequantize_row`).
fn element(ty: WeightType, b: &[u8], e: usize) -> f32 {
    let nibble = |qs: usize, i: usize| (b[qs + i % 16] >> (4 * (i / 16))) & 0x0f;
    let high = |at: usize, i: usize| {
        let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        ((qh >> i) & 1) as u8
    };
    match ty {
        WeightType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        WeightType::F16 => half(b, 0),
        WeightType::Bf16 => f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16),
        WeightType::Q4_0 => half(b, 0) * (nibble(2, e) as i8 - 8) as f32,
        WeightType::Q4_1 => half(b, 0) * nibble(4, e) as f32 + half(b, 2),
        WeightType::Q5_0 => half(b, 0) * ((nibble(6, e) | high(2, e) << 4) as i8 - 16) as f32,
        WeightType::Q5_1 => half(b, 0) * (nibble(8, e) | high(4, e) << 4) as f32 + half(b, 2),
        WeightType::Q8_0 => b[2 + e] as i8 as f32 * half(b, 0),
        WeightType::Mxfp4 => e8m0_half(b[0]) * MXFP4_VALUES[nibble(1, e) as usize] as f32,
        WeightType::Q4K => {
            let s = e / 32; // sub-block: nibble s % 2 of qs[32 * (s / 2) + e % 32]
            let (sc, mn) = q4k_scale_min(&b[4..16], s);
            let q = (b[16 + 32 * (s / 2) + e % 32] >> (4 * (s % 2))) & 0x0f;
            let (d, dm) = (half(b, 0) * sc as f32, half(b, 2) * mn as f32);
            d * q as f32 - dm
        }
        WeightType::Q6K => {
            let (a, r) = (e / 128, e % 128); // half of the block, element within it
            let ql = (b[64 * a + r % 64] >> (4 * (r / 64))) & 0x0f;
            let qh = (b[128 + 32 * a + r % 32] >> (2 * (r / 32))) & 0x03;
            let q = (ql | qh << 4) as i8 - 32;
            let d = half(b, 208) * b[192 + e / 16] as i8 as f32;
            d * q as f32
        }
    }
}

/// `load_tail` of a 16-bit float format: the last elements copied into a zeroed full step of
/// `$lanes`, then loaded as one.
macro_rules! padded_tail {
    ($lanes:expr, $vec:ty, $features:literal) => {
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn load_tail(row: *const u8, t: usize, len: usize) -> $vec {
            let mut padded = [0u16; $lanes];
            std::ptr::copy_nonoverlapping((row as *const u16).add(t), padded.as_mut_ptr(), len);
            Self::load(padded.as_ptr() as *const u8, 0)
        }
    };
}

/// MXFP4's doubled integer values of the 16 code bytes at qs: (elements 0..16 from the low
/// nibbles, elements 16..32 from the high), as signed bytes (one table lookup each).
///
/// # Safety
/// qs holds 16 readable bytes and the CPU runs SSSE3.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "ssse3")]
pub unsafe fn mxfp4_values(
    qs: *const u8,
) -> (std::arch::x86_64::__m128i, std::arch::x86_64::__m128i) {
    use std::arch::x86_64::*;
    let v = _mm_loadu_si128(qs as *const __m128i);
    let table = _mm_loadu_si128(MXFP4_VALUES.as_ptr() as *const __m128i);
    let low = _mm_set1_epi8(0x0f);
    (
        _mm_shuffle_epi8(table, _mm_and_si128(v, low)),
        _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16::<4>(v), low)),
    )
}

/// The 16-lane loaders. Float formats: `load(row, t)` is elements t..t + 16 (t a multiple of
/// 16) and `load_tail` a shorter last step. Block formats: `load32(row, t)` is elements
/// t..t + 32 (t a multiple of 32) as two vectors, one block or sub-block of 32 with its scales
/// read once; a row holds whole blocks, so no tail exists.
#[cfg(target_arch = "x86_64")]
pub mod avx512 {
    use std::arch::x86_64::*;

    /// A weight format the AVX-512 kernel loads as float32 lanes.
    pub trait Load: Copy + Sync {
        /// Whether rows are GGUF blocks (loaded 32 elements at a time, `load32`).
        const BLOCKED: bool;
        /// Elements t..t+16 of `row` (float formats).
        ///
        /// # Safety
        /// `row` holds at least t + 16 elements of this format and the CPU runs AVX-512F and
        /// F16C.
        unsafe fn load(row: *const u8, t: usize) -> __m512;
        /// Elements t..t+len (len < 16), zeros above (float formats).
        ///
        /// # Safety
        /// As `load`, for t + len elements.
        unsafe fn load_tail(row: *const u8, t: usize, len: usize) -> __m512;
        /// Elements t..t+32 of `row` as two vectors (t a multiple of 32).
        ///
        /// # Safety
        /// As `load`, for t + 32 elements.
        unsafe fn load32(row: *const u8, t: usize) -> [__m512; 2];
    }

    /// The fp16 values at p and p + 2, widened: (value at p, value at p + 2) broadcast.
    #[inline]
    #[target_feature(enable = "avx512f,f16c")]
    unsafe fn halves(p: *const u8) -> (__m512, __m512) {
        let bits = std::ptr::read_unaligned(p as *const u32);
        let two = _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)); // [a, b, 0, 0]
        (
            _mm512_broadcastss_ps(two),
            _mm512_broadcastss_ps(_mm_movehdup_ps(two)),
        )
    }

    /// The fp16 value at p, widened and broadcast.
    #[inline]
    #[target_feature(enable = "avx512f,f16c")]
    unsafe fn half(p: *const u8) -> __m512 {
        let bits = std::ptr::read_unaligned(p as *const u16);
        _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// 16 bytes at p as u32 lanes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn bytes(p: *const u8) -> __m512i {
        _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i))
    }

    /// (low nibbles, high nibbles) of 16 bytes at p, as u32 lanes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn nibbles(p: *const u8) -> (__m512i, __m512i) {
        let v = bytes(p);
        (
            _mm512_and_si512(v, _mm512_set1_epi32(0x0f)),
            _mm512_srli_epi32::<4>(v),
        )
    }

    /// Nibble `high` (0 low, 1 high) of each of 16 bytes at p.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn nibble(p: *const u8, high: bool) -> __m512i {
        let v = bytes(p);
        if high {
            _mm512_srli_epi32::<4>(v)
        } else {
            _mm512_and_si512(v, _mm512_set1_epi32(0x0f))
        }
    }

    /// Lanes j of (lo, hi) | 16 where bit j (lo) or 16 + j (hi) of the u32 at qh is set.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn with_high(lo: __m512i, hi: __m512i, qh: *const u8) -> (__m512i, __m512i) {
        let bits = std::ptr::read_unaligned(qh as *const u32);
        let sixteen = _mm512_set1_epi32(16);
        (
            _mm512_mask_or_epi32(lo, bits as u16, lo, sixteen),
            _mm512_mask_or_epi32(hi, (bits >> 16) as u16, hi, sixteen),
        )
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn float(q: __m512i) -> __m512 {
        _mm512_cvtepi32_ps(q)
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn minus(q: __m512i, c: i32) -> __m512i {
        _mm512_sub_epi32(q, _mm512_set1_epi32(c))
    }

    /// `load` / `load_tail` of block formats, and `load32` of float formats, never called.
    macro_rules! blocked {
        () => {
            const BLOCKED: bool = true;
            unsafe fn load(_: *const u8, _: usize) -> __m512 {
                unreachable!("block formats load 32 elements at a time")
            }
            unsafe fn load_tail(_: *const u8, _: usize, _: usize) -> __m512 {
                unreachable!("block formats have whole blocks per row")
            }
        };
    }
    macro_rules! float_format {
        () => {
            const BLOCKED: bool = false;
            unsafe fn load32(_: *const u8, _: usize) -> [__m512; 2] {
                unreachable!("float formats load 16 elements at a time")
            }
        };
    }

    #[derive(Clone, Copy)]
    pub struct F32;
    #[derive(Clone, Copy)]
    pub struct F16;
    #[derive(Clone, Copy)]
    pub struct Bf16;
    #[derive(Clone, Copy)]
    pub struct Q4_0;
    #[derive(Clone, Copy)]
    pub struct Q4_1;
    #[derive(Clone, Copy)]
    pub struct Q5_0;
    #[derive(Clone, Copy)]
    pub struct Q5_1;
    #[derive(Clone, Copy)]
    pub struct Q8_0;
    #[derive(Clone, Copy)]
    pub struct Q4K;
    #[derive(Clone, Copy)]
    pub struct Q6K;
    #[derive(Clone, Copy)]
    pub struct Mxfp4;

    impl Load for F32 {
        float_format!();
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load(row: *const u8, t: usize) -> __m512 {
            _mm512_loadu_ps((row as *const f32).add(t))
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load_tail(row: *const u8, t: usize, len: usize) -> __m512 {
            _mm512_maskz_loadu_ps((1u16 << len) - 1, (row as *const f32).add(t))
        }
    }

    /// IEEE half bits, widened by F16C's conversion (exact: every fp16 value is a float32).
    impl Load for F16 {
        float_format!();
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load(row: *const u8, t: usize) -> __m512 {
            _mm512_cvtph_ps(_mm256_loadu_si256(
                (row as *const u16).add(t) as *const __m256i
            ))
        }
        padded_tail!(16, __m512, "avx512f");
    }

    /// bfloat16 bits: a float32 with the low 16 bits zero, so widening is exact.
    impl Load for Bf16 {
        float_format!();
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load(row: *const u8, t: usize) -> __m512 {
            let p = (row as *const u16).add(t) as *const __m256i;
            let bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(bits))
        }
        padded_tail!(16, __m512, "avx512f");
    }

    /// d * (q - 8); block: d, qs[16] (element j: nibble j / 16 of qs[j % 16]).
    impl Load for Q4_0 {
        blocked!();
        #[inline]
        #[target_feature(enable = "avx512f,f16c")]
        unsafe fn load32(row: *const u8, t: usize) -> [__m512; 2] {
            let b = row.add(t / 32 * 18);
            let d = half(b);
            let (lo, hi) = nibbles(b.add(2));
            [
                _mm512_mul_ps(d, float(minus(lo, 8))),
                _mm512_mul_ps(d, float(minus(hi, 8))),
            ]
        }
    }

    /// d * q + m; block: d, m, qs[16].
    impl Load for Q4_1 {
        blocked!();
        #[inline]
        #[target_feature(enable = "avx512f,f16c")]
        unsafe fn load32(row: *const u8, t: usize) -> [__m512; 2] {
            let b = row.add(t / 32 * 20);
            let (d, m) = halves(b);
            let (lo, hi) = nibbles(b.add(4));
            [
                _mm512_fmadd_ps(d, float(lo), m),
                _mm512_fmadd_ps(d, float(hi), m),
            ]
        }
    }

    /// d * (q - 16), q = nibble | bit j of qh << 4; block: d, qh[4], qs[16].
    impl Load for Q5_0 {
        blocked!();
        #[inline]
        #[target_feature(enable = "avx512f,f16c")]
        unsafe fn load32(row: *const u8, t: usize) -> [__m512; 2] {
            let b = row.add(t / 32 * 22);
            let d = half(b);
            let (lo, hi) = nibbles(b.add(6));
            let (lo, hi) = with_high(lo, hi, b.add(2));
            [
                _mm512_mul_ps(d, float(minus(lo, 16))),
                _mm512_mul_ps(d, float(minus(hi, 16))),
            ]
        }
    }

    /// d * q + m, q = nibble | bit j of qh << 4; block: d, m, qh[4], qs[16].
    impl Load for Q5_1 {
        blocked!();
        #[inline]
        #[target_feature(enable = "avx512f,f16c")]
        unsafe fn load32(row: *const u8, t: usize) -> [__m512; 2] {
            let b = row.add(t / 32 * 24);
            let (d, m) = halves(b);
            let (lo, hi) = nibbles(b.add(8));
            let (lo, hi) = with_high(lo, hi, b.add(4));
            [
                _mm512_fmadd_ps(d, float(lo), m),
                _mm512_fmadd_ps(d, float(hi), m),
            ]
        }
    }

    /// q * d; block: d, qs[32] (int8).
    impl Load for Q8_0 {
        blocked!();
        #[inline]
        #[target_feature(enable = "avx512f,f16c")]
        unsafe fn load32(row: *const u8, t: usize) -> [__m512; 2] {
            let b = row.add(t / 32 * 34);
            let d = half(b);
            let q = |at: usize| _mm512_cvtepi8_epi32(_mm_loadu_si128(b.add(at) as *const __m128i));
            [
                _mm512_mul_ps(float(q(2)), d),
                _mm512_mul_ps(float(q(18)), d),
            ]
        }
    }

    /// (d * sc) * q - (dmin * mn) per sub-block of 32; block: d, dmin, scales[12], qs[128]
    /// (sub-block s: nibble s % 2 of qs[32 * (s / 2)..][..32]).
    impl Load for Q4K {
        blocked!();
        #[inline]
        #[target_feature(enable = "avx512f,f16c")]
        unsafe fn load32(row: *const u8, t: usize) -> [__m512; 2] {
            let b = row.add(t / 256 * 144);
            let s = t % 256 / 32;
            let (sc, mn) = super::q4k_scale_min(std::slice::from_raw_parts(b.add(4), 12), s);
            let (d, dmin) = halves(b);
            let d = _mm512_mul_ps(d, _mm512_set1_ps(sc as f32));
            let dm = _mm512_mul_ps(dmin, _mm512_set1_ps(mn as f32));
            let qs = b.add(16 + 32 * (s / 2));
            let high = s % 2 == 1;
            [
                _mm512_fmsub_ps(d, float(nibble(qs, high)), dm),
                _mm512_fmsub_ps(d, float(nibble(qs.add(16), high)), dm),
            ]
        }
    }

    /// (d * sc) * (q - 32) per 16 elements, q = ql nibble | qh 2 bits << 4; block: ql[128],
    /// qh[64], scales[16] (int8), d.
    impl Load for Q6K {
        blocked!();
        #[inline]
        #[target_feature(enable = "avx512f,f16c")]
        unsafe fn load32(row: *const u8, t: usize) -> [__m512; 2] {
            let b = row.add(t / 256 * 210);
            let (e, a, r) = (t % 256, t % 256 / 128, t % 128);
            let ql = b.add(64 * a + r % 64);
            let qh = b.add(128 + 32 * a);
            let shift = _mm_cvtsi32_si128((r / 32 * 2) as i32);
            let d = half(b.add(208));
            let q = |i: usize| {
                let hi = _mm512_srl_epi32(bytes(qh.add(16 * i)), shift);
                let hi = _mm512_and_si512(hi, _mm512_set1_epi32(3));
                let q =
                    _mm512_or_si512(nibble(ql.add(16 * i), r >= 64), _mm512_slli_epi32::<4>(hi));
                let sc = *b.add(192 + e / 16 + i) as i8 as f32;
                _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(sc)), float(minus(q, 32)))
            };
            [q(0), q(1)]
        }
    }

    /// e8m0_half(e) * value(code); block: e (E8M0), qs[16] (element j: nibble j / 16 of
    /// qs[j % 16]).
    impl Load for Mxfp4 {
        blocked!();
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load32(row: *const u8, t: usize) -> [__m512; 2] {
            let b = row.add(t / 32 * 17);
            let d = _mm512_set1_ps(super::e8m0_half(*b));
            let (lo, hi) = super::mxfp4_values(b.add(1));
            [
                _mm512_mul_ps(d, float(_mm512_cvtepi8_epi32(lo))),
                _mm512_mul_ps(d, float(_mm512_cvtepi8_epi32(hi))),
            ]
        }
    }
}

/// The 8-lane loaders of the AVX2 kernel, the same values as `avx512`'s: `load` gives 8
/// elements (float formats), `load32` 32 as four vectors (block formats).
#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    use std::arch::x86_64::*;

    /// A weight format the AVX2 kernel loads as float32 lanes.
    pub trait Load: Copy + Sync {
        /// Whether rows are GGUF blocks (loaded 32 elements at a time, `load32`).
        const BLOCKED: bool;
        /// Elements t..t+8 of `row` (float formats).
        ///
        /// # Safety
        /// `row` holds at least t + 8 elements of this format and the CPU runs AVX2, FMA and
        /// F16C.
        unsafe fn load(row: *const u8, t: usize) -> __m256;
        /// Elements t..t+len (len < 8), zeros above (float formats).
        ///
        /// # Safety
        /// As `load`, for t + len elements.
        unsafe fn load_tail(row: *const u8, t: usize, len: usize) -> __m256;
        /// Elements t..t+32 as four vectors (t a multiple of 32).
        ///
        /// # Safety
        /// As `load`, for t + 32 elements.
        unsafe fn load32(row: *const u8, t: usize) -> [__m256; 4];
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn halves(p: *const u8) -> (__m256, __m256) {
        let bits = std::ptr::read_unaligned(p as *const u32);
        let two = _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32));
        (
            _mm256_broadcastss_ps(two),
            _mm256_broadcastss_ps(_mm_movehdup_ps(two)),
        )
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn half(p: *const u8) -> __m256 {
        let bits = std::ptr::read_unaligned(p as *const u16);
        _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// 8 bytes at p as u32 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn bytes(p: *const u8) -> __m256i {
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i))
    }

    /// Nibble `high` of each of 8 bytes at p.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn nibble(p: *const u8, high: bool) -> __m256i {
        let v = bytes(p);
        if high {
            _mm256_srli_epi32::<4>(v)
        } else {
            _mm256_and_si256(v, _mm256_set1_epi32(0x0f))
        }
    }

    /// The 32 nibble values of a 16-byte qs array in element order (low nibbles, then high).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn nibbles(qs: *const u8) -> [__m256i; 4] {
        [
            nibble(qs, false),
            nibble(qs.add(8), false),
            nibble(qs, true),
            nibble(qs.add(8), true),
        ]
    }

    /// q[i] | 16 in lane j where bit 8 i + j of the u32 at qh is set.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn with_high(q: [__m256i; 4], qh: *const u8) -> [__m256i; 4] {
        let bits = _mm256_set1_epi32(std::ptr::read_unaligned(qh as *const u32) as i32);
        let mut out = q;
        for (i, o) in out.iter_mut().enumerate() {
            let first = 8 * i as i32;
            let lane = _mm256_setr_epi32(
                first,
                first + 1,
                first + 2,
                first + 3,
                first + 4,
                first + 5,
                first + 6,
                first + 7,
            );
            let bit = _mm256_and_si256(_mm256_srlv_epi32(bits, lane), _mm256_set1_epi32(1));
            *o = _mm256_or_si256(*o, _mm256_slli_epi32::<4>(bit));
        }
        out
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn float(q: __m256i) -> __m256 {
        _mm256_cvtepi32_ps(q)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn minus(q: __m256i, c: i32) -> __m256i {
        _mm256_sub_epi32(q, _mm256_set1_epi32(c))
    }

    /// d * (q - c) for four vectors of q.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn scaled(d: __m256, q: [__m256i; 4], c: i32) -> [__m256; 4] {
        q.map(|q| _mm256_mul_ps(d, float(minus(q, c))))
    }

    /// d * q + m for four vectors of q.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn affine(d: __m256, q: [__m256i; 4], m: __m256) -> [__m256; 4] {
        q.map(|q| _mm256_fmadd_ps(d, float(q), m))
    }

    macro_rules! blocked {
        () => {
            const BLOCKED: bool = true;
            unsafe fn load(_: *const u8, _: usize) -> __m256 {
                unreachable!("block formats load 32 elements at a time")
            }
            unsafe fn load_tail(_: *const u8, _: usize, _: usize) -> __m256 {
                unreachable!("block formats have whole blocks per row")
            }
        };
    }
    macro_rules! float_format {
        () => {
            const BLOCKED: bool = false;
            unsafe fn load32(_: *const u8, _: usize) -> [__m256; 4] {
                unreachable!("float formats load 8 elements at a time")
            }
        };
    }

    pub use super::avx512::{Bf16, Mxfp4, F16, F32, Q4K, Q4_0, Q4_1, Q5_0, Q5_1, Q6K, Q8_0};

    impl Load for F32 {
        float_format!();
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn load(row: *const u8, t: usize) -> __m256 {
            _mm256_loadu_ps((row as *const f32).add(t))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn load_tail(row: *const u8, t: usize, len: usize) -> __m256 {
            let mut padded = [0f32; 8];
            std::ptr::copy_nonoverlapping((row as *const f32).add(t), padded.as_mut_ptr(), len);
            _mm256_loadu_ps(padded.as_ptr())
        }
    }

    impl Load for F16 {
        float_format!();
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load(row: *const u8, t: usize) -> __m256 {
            _mm256_cvtph_ps(_mm_loadu_si128((row as *const u16).add(t) as *const __m128i))
        }
        padded_tail!(8, __m256, "avx2,fma,f16c");
    }

    impl Load for Bf16 {
        float_format!();
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn load(row: *const u8, t: usize) -> __m256 {
            let p = (row as *const u16).add(t) as *const __m128i;
            let bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(p));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(bits))
        }
        padded_tail!(8, __m256, "avx2,fma");
    }

    impl Load for Q4_0 {
        blocked!();
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load32(row: *const u8, t: usize) -> [__m256; 4] {
            let b = row.add(t / 32 * 18);
            scaled(half(b), nibbles(b.add(2)), 8)
        }
    }

    impl Load for Q4_1 {
        blocked!();
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load32(row: *const u8, t: usize) -> [__m256; 4] {
            let b = row.add(t / 32 * 20);
            let (d, m) = halves(b);
            affine(d, nibbles(b.add(4)), m)
        }
    }

    impl Load for Q5_0 {
        blocked!();
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load32(row: *const u8, t: usize) -> [__m256; 4] {
            let b = row.add(t / 32 * 22);
            scaled(half(b), with_high(nibbles(b.add(6)), b.add(2)), 16)
        }
    }

    impl Load for Q5_1 {
        blocked!();
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load32(row: *const u8, t: usize) -> [__m256; 4] {
            let b = row.add(t / 32 * 24);
            let (d, m) = halves(b);
            affine(d, with_high(nibbles(b.add(8)), b.add(4)), m)
        }
    }

    impl Load for Q8_0 {
        blocked!();
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load32(row: *const u8, t: usize) -> [__m256; 4] {
            let b = row.add(t / 32 * 34);
            let d = half(b);
            [0, 1, 2, 3].map(|i| {
                let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(b.add(2 + 8 * i) as *const __m128i));
                _mm256_mul_ps(float(q), d)
            })
        }
    }

    impl Load for Q4K {
        blocked!();
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load32(row: *const u8, t: usize) -> [__m256; 4] {
            let b = row.add(t / 256 * 144);
            let s = t % 256 / 32;
            let (sc, mn) = super::q4k_scale_min(std::slice::from_raw_parts(b.add(4), 12), s);
            let (d, dmin) = halves(b);
            let d = _mm256_mul_ps(d, _mm256_set1_ps(sc as f32));
            let dm = _mm256_mul_ps(dmin, _mm256_set1_ps(mn as f32));
            let qs = b.add(16 + 32 * (s / 2));
            [0, 1, 2, 3].map(|i| _mm256_fmsub_ps(d, float(nibble(qs.add(8 * i), s % 2 == 1)), dm))
        }
    }

    impl Load for Q6K {
        blocked!();
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn load32(row: *const u8, t: usize) -> [__m256; 4] {
            let b = row.add(t / 256 * 210);
            let (e, a, r) = (t % 256, t % 256 / 128, t % 128);
            let ql = b.add(64 * a + r % 64);
            let qh = b.add(128 + 32 * a);
            let shift = _mm_cvtsi32_si128((r / 32 * 2) as i32);
            let d = half(b.add(208));
            [0, 1, 2, 3].map(|i| {
                let hi = _mm256_srl_epi32(bytes(qh.add(8 * i)), shift);
                let hi = _mm256_and_si256(hi, _mm256_set1_epi32(3));
                let q = _mm256_or_si256(nibble(ql.add(8 * i), r >= 64), _mm256_slli_epi32::<4>(hi));
                let sc = *b.add(192 + e / 16 + i / 2) as i8 as f32;
                _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(sc)), float(minus(q, 32)))
            })
        }
    }

    impl Load for Mxfp4 {
        blocked!();
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn load32(row: *const u8, t: usize) -> [__m256; 4] {
            let b = row.add(t / 32 * 17);
            let d = _mm256_set1_ps(super::e8m0_half(*b));
            let (lo, hi) = super::mxfp4_values(b.add(1));
            [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)]
                .map(|q| _mm256_mul_ps(d, float(_mm256_cvtepi8_epi32(q))))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::small_gemm as gemm;
    use crate::testutil::random_blocks;

    #[test]
    fn f16_conversion_is_exact_for_every_value() {
        for h in 0..=u16::MAX {
            let got = f16_to_f32(h);
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("f16c") {
                // SAFETY: the CPU has F16C (checked).
                let want = unsafe {
                    use std::arch::x86_64::*;
                    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
                };
                // NaN payloads aside (F16C quiets a signalling NaN), the same bits
                let same = got.to_bits() == want.to_bits() || got.is_nan() && want.is_nan();
                assert!(same, "{h:#06x}");
            }
            if h & 0x7c00 != 0x7c00 {
                let (sign, exp, frac) = (h >> 15, (h >> 10) & 31, (h & 1023) as f64);
                let mag = if exp == 0 {
                    frac * 2f64.powi(-24)
                } else {
                    (1.0 + frac / 1024.0) * 2f64.powi(exp as i32 - 15)
                };
                assert_eq!(got as f64, if sign == 1 { -mag } else { mag }, "{h:#06x}");
            }
        }
    }

    #[test]
    fn geometry_follows_ggml() {
        assert_eq!(WeightType::from_ggml(3), Some(WeightType::Q4_1));
        assert_eq!(WeightType::from_ggml(13), None); // Q5_K: not read natively
        assert_eq!(WeightType::Q4K.row_bytes(512), Some(288));
        assert_eq!(WeightType::Q4_1.row_bytes(40), None);
        assert_eq!(WeightType::F32.row_bytes(3), Some(12));
        for ty in ALL {
            assert_eq!(WeightType::from_ggml(ty.ggml_id()), Some(ty));
        }
    }

    /// Every copy's lanes (through `gather_rows`, the GEMM's loaders) give the reference's
    /// values bit for bit, for every block format.
    #[test]
    fn lanes_equal_the_reference_dequantizer() {
        for ty in ALL.into_iter().filter(|t| t.is_quantized()) {
            let (rows, k) = (5, 2 * ty.block().0);
            let data = random_blocks(ty, rows, k, ty.ggml_id() as u64);
            let rb = ty.row_bytes(k).unwrap();
            let mut want = vec![0f32; rows * k];
            for (r, o) in data.chunks_exact(rb).zip(want.chunks_exact_mut(k)) {
                dequantize_row(ty, r, o);
            }
            for isa in gemm::supported() {
                let ids: Vec<i64> = vec![4, 0, 2, 2, 1, 3];
                let mut got = vec![f32::NAN; ids.len() * k];
                gemm::gather_rows_on(isa, ty, &data, k, &ids, &mut got);
                for (i, &id) in ids.iter().enumerate() {
                    let (g, w) = (&got[i * k..][..k], &want[id as usize * k..][..k]);
                    let same = g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{ty:?} {isa:?} row {id}");
                }
            }
        }
    }

    #[test]
    fn mxfp4_scales_follow_ggml_bits() {
        assert_eq!(e8m0_half(0).to_bits(), 0x0020_0000); // 2^-128, subnormal
        assert_eq!(e8m0_half(1).to_bits(), 0x0040_0000); // 2^-127, subnormal
        for (e, p) in [
            (0u8, -128),
            (1, -127),
            (2, -126),
            (127, -1),
            (128, 0),
            (255, 127),
        ] {
            assert_eq!(e8m0_half(e) as f64, 2f64.powi(p), "e = {e}");
        }
    }

    /// Every code and the edge exponents: value = E2M1(code) * 2^(e - 127) (E2M1: 0, 0.5, 1,
    /// 1.5, 2, 3, 4, 6 and their negatives), code 8 +0, and e = 255's large codes infinite as
    /// the reference's float32 product is; the lanes of each copy give the same bits.
    #[test]
    fn mxfp4_values_are_e2m1_times_the_exponent() {
        let e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        let exps = [0u8, 1, 2, 127, 130, 254, 255];
        let mut row = Vec::new();
        for &e in &exps {
            row.push(e);
            // elements j (low nibble) and 16 + j (high): codes j and 15 - j
            row.extend((0..16u8).map(|j| j | (15 - j) << 4));
        }
        let mut out = vec![0f32; 32 * exps.len()];
        dequantize_row(WeightType::Mxfp4, &row, &mut out);
        for (b, &e) in exps.iter().enumerate() {
            for i in 0..32 {
                let code = if i < 16 { i } else { 31 - i };
                let mag = e2m1[code & 7] * 2f64.powi(e as i32 - 127);
                let want = if code >= 8 { -mag } else { mag };
                let want = if want.abs() > f32::MAX as f64 {
                    want.signum() * f64::INFINITY
                } else {
                    want
                };
                let got = out[32 * b + i];
                assert_eq!(got as f64, want, "e = {e} code {code}");
                assert!(code != 8 || got.to_bits() == 0, "code 8 is +0");
            }
        }
        for isa in gemm::supported() {
            let mut got = vec![f32::NAN; out.len()];
            gemm::gather_rows_on(isa, WeightType::Mxfp4, &row, out.len(), &[0], &mut got);
            let same = got
                .iter()
                .zip(&out)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{isa:?}");
        }
    }
}
