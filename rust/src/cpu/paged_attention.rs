//! Paged attention in float32 for the few query rows per sequence of CPU decode and verify
//! steps, read straight from the paged KV cache.
//!
//! Why native: the torch backend gathers every sequence's K/V blocks into a padded buffer,
//! builds a mask and calls SDPA, ~125 µs per layer at batch 1 (~50 µs of it the gather) and
//! more for a verify step's mask. Reading the cache through the block table costs only the
//! dot products. Prefill-sized queries stay on SDPA, whose blocked GEMMs win there.
//!
//! Shapes (vLLM's vocabulary, see `attention/base.py`):
//!   q, out        [T, Hq, D]  T packed query rows; sequence i owns rows cu_seqlens_q[i]..[i+1]
//!   kv_cache      [2, num_blocks, block_size, Hkv, D]  (0 = K, 1 = V)
//!   block_tables  [B, max_blocks], seq_lens [B] (context after this step, queries included)
//! Query row j of sequence i (q_i rows, k_i = seq_lens[i]) sits at position k_i - q_i + j and
//! attends to keys 0..=that position; head h reads KV head h / (Hq / Hkv).
//!
//! Numerics: one pass of online softmax per query row, keys in position order, each score a
//! 16-lane dot product with a fixed lane reduction. A row's result depends only on its own
//! query and keys, not on the other rows, sequences or threads of the call, so a verify step
//! reproduces a decode step bit for bit. All CPU variants compute the same operations (Rust
//! never fuses or reorders float arithmetic); only the vector width differs.
//!
//! Work: a thread takes a run of (sequence, head) items and hands the kernel each stretch of
//! consecutive heads that read one KV head. The AVX-512 kernel computes up to R of that
//! stretch's rows (query rows x heads) together: each key and value vector loaded serves all
//! of them, and 16 keys' lane reductions share their shuffles. Per row, the operations and
//! their order are still those of the generic `head`.

use crate::cpu::omp;

/// The largest head_dim the kernel takes (its accumulator lives on the stack).
pub const MAX_HEAD_DIM: usize = 256;

/// Below this many multiply-adds a call runs on the calling thread: handing out parts costs
/// a few µs, the whole of a batch-1 call at short contexts.
const PARALLEL_MIN_MACS: usize = 1 << 18;

const LANES: usize = 16;

/// The sizes of a layer's cache and of its heads.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    /// Columns of `block_tables`.
    pub max_blocks: usize,
}

/// Which query rows belong to which sequence, and where each sequence's keys are.
#[derive(Clone, Copy, Debug)]
pub struct Step<'a> {
    pub cu_seqlens_q: &'a [i32],
    pub seq_lens: &'a [i32],
    pub block_tables: &'a [i32],
}

impl Step<'_> {
    fn num_seqs(&self) -> usize {
        self.seq_lens.len()
    }

    /// (first query row, q_i, k_i) of sequence i; valid after `check`.
    fn seq(&self, i: usize) -> (usize, usize, usize) {
        let start = self.cu_seqlens_q[i] as usize;
        let end = self.cu_seqlens_q[i + 1] as usize;
        (start, end - start, self.seq_lens[i] as usize)
    }
}

/// Checks that every index the kernel will follow stays inside the buffers of `layout`
/// holding `num_tokens` query rows.
pub fn check(layout: &Layout, step: &Step, num_tokens: usize) -> Result<(), String> {
    let l = layout;
    if l.num_heads == 0 || l.num_kv_heads == 0 || !l.num_heads.is_multiple_of(l.num_kv_heads) {
        return Err(format!(
            "num_heads {} must be a positive multiple of num_kv_heads {}",
            l.num_heads, l.num_kv_heads
        ));
    }
    if !(1..=MAX_HEAD_DIM).contains(&l.head_dim) || l.block_size == 0 {
        return Err(format!(
            "head_dim {} must be in 1..={MAX_HEAD_DIM}, block_size {} > 0",
            l.head_dim, l.block_size
        ));
    }
    let b = step.num_seqs();
    if step.cu_seqlens_q.len() != b + 1 || step.block_tables.len() != b * l.max_blocks {
        return Err(format!(
            "{b} sequences need cu_seqlens_q [{}] and block_tables [{b}, {}]",
            b + 1,
            l.max_blocks
        ));
    }
    if step.cu_seqlens_q[0] != 0 || step.cu_seqlens_q[b] as i64 != num_tokens as i64 {
        return Err(format!(
            "cu_seqlens_q must run from 0 to the {num_tokens} query rows"
        ));
    }
    for i in 0..b {
        let (start, end) = (step.cu_seqlens_q[i], step.cu_seqlens_q[i + 1]);
        let k = step.seq_lens[i] as i64;
        let q = end as i64 - start as i64;
        if q < 1 || q > k || k > (l.max_blocks * l.block_size) as i64 {
            return Err(format!(
                "sequence {i}: needs 1 <= q ({q}) <= seq_len ({k}) <= max_blocks * block_size"
            ));
        }
        let used = (k as usize).div_ceil(l.block_size);
        let row = &step.block_tables[i * l.max_blocks..][..used];
        if let Some(bad) = row
            .iter()
            .find(|&&blk| blk < 0 || blk as usize >= l.num_blocks)
        {
            return Err(format!(
                "sequence {i}: block id {bad} outside the cache's {} blocks",
                l.num_blocks
            ));
        }
    }
    Ok(())
}

/// out = softmax(q K^T * scale) V per (sequence, head, query row), on up to `threads` threads
/// of libgomp's team (`omp`). Errors on inconsistent shapes or indices (see `check`).
pub fn attend(
    q: &[f32],
    kv_cache: &[f32],
    out: &mut [f32],
    layout: &Layout,
    step: &Step,
    scale: f32,
    threads: usize,
) -> Result<(), String> {
    attend_split(
        q,
        kv_cache,
        out,
        layout,
        step,
        scale,
        threads,
        PARALLEL_MIN_MACS,
    )
}

/// `attend`, splitting the work only from `min_macs` multiply-adds on (tests split tiny calls).
#[allow(clippy::too_many_arguments)]
fn attend_split(
    q: &[f32],
    kv_cache: &[f32],
    out: &mut [f32],
    layout: &Layout,
    step: &Step,
    scale: f32,
    threads: usize,
    min_macs: usize,
) -> Result<(), String> {
    let l = *layout;
    check_buffers(&l, step, q, out, kv_cache)?;
    let bounds = partition(&l, step, threads, min_macs);
    let kernel = select();
    let out_addr = out.as_mut_ptr() as usize;
    let job = Items {
        q,
        kv_cache,
        layout: l,
        step,
        scale,
    };
    omp::run(bounds.len() - 1, &|part| {
        // SAFETY: the parts' item ranges are disjoint, so their writes are (see `run`); `out`
        // outlives `omp::run` and its size was checked against q's.
        unsafe { job.run(bounds[part]..bounds[part + 1], kernel, out_addr as *mut f32) }
    });
    Ok(())
}

/// `check` of the step, then q [T, Hq * D] with T whole rows, out the size of q and the
/// whole cache [2, num_blocks, block_size, Hkv, D].
fn check_buffers(
    l: &Layout,
    step: &Step,
    q: &[f32],
    out: &[f32],
    kv_cache: &[f32],
) -> Result<(), String> {
    let row_len = l.num_heads * l.head_dim;
    let num_tokens = q.len() / row_len.max(1);
    check(l, step, num_tokens)?;
    let cache_len = 2 * l.num_blocks * l.block_size * l.num_kv_heads * l.head_dim;
    if q.len() != num_tokens * row_len || out.len() != q.len() || kv_cache.len() != cache_len {
        return Err(format!(
            "buffer sizes: q {}, out {}, kv_cache {} (want {cache_len})",
            q.len(),
            out.len(),
            kv_cache.len()
        ));
    }
    Ok(())
}

/// Splits the work items, (sequence, head) pairs numbered seq * Hq + head, into contiguous
/// runs of about equal cost (q_len * k_len each): one run below `min_macs` multiply-adds in
/// all, else `threads` (at least 1, at most one per item). Returns the runs' bounds: parts + 1
/// non-decreasing values from 0 to the number of items.
fn partition(l: &Layout, step: &Step, threads: usize, min_macs: usize) -> Vec<usize> {
    let items = step.num_seqs() * l.num_heads;
    let cost = |item: usize| {
        let (_, q_len, k_len) = step.seq(item / l.num_heads);
        q_len * k_len
    };
    let total: usize = (0..items).map(cost).sum();
    let parts = if total * l.head_dim < min_macs {
        1
    } else {
        threads.clamp(1, items)
    };
    let mut bounds = Vec::with_capacity(parts + 1);
    bounds.push(0);
    let mut done = 0;
    for item in 0..items {
        done += cost(item);
        // close a part once it holds its share of the total
        if bounds.len() < parts && done * parts >= total * bounds.len() {
            bounds.push(item + 1);
        }
    }
    while bounds.len() <= parts {
        bounds.push(items);
    }
    bounds
}

/// The inputs every work item of one `attend` call reads (all checked by `check_buffers`).
struct Items<'a> {
    q: &'a [f32],
    kv_cache: &'a [f32],
    layout: Layout,
    step: &'a Step<'a>,
    scale: f32,
}

impl Items<'_> {
    /// Runs the kernel over work items `items`, a sequence's heads that share a KV head (and
    /// lie in the range) in one call.
    ///
    /// # Safety
    /// `out` must point to a buffer the size of q that outlives the call; concurrent calls
    /// must get disjoint ranges (each (row, head) slice is written by one item only);
    /// `kernel` must suit this CPU (`select`).
    unsafe fn run(&self, items: std::ops::Range<usize>, kernel: Kernel, out: *mut f32) {
        let l = self.layout;
        let row_len = l.num_heads * l.head_dim;
        let group = l.num_heads / l.num_kv_heads;
        let (mut item, end) = (items.start, items.end);
        while item < end {
            let (seq, head) = (item / l.num_heads, item % l.num_heads);
            // this part's consecutive heads of the sequence that read the same KV head
            let heads = (group - head % group).min(end - item);
            let (start, q_len, k_len) = self.step.seq(seq);
            let table =
                &self.step.block_tables[seq * l.max_blocks..][..k_len.div_ceil(l.block_size)];
            let job = Head {
                q: &self.q[start * row_len + head * l.head_dim..],
                row_stride: row_len,
                kv_cache: self.kv_cache,
                kv_head: head / group,
                heads,
                table,
                q_len,
                k_len,
                layout: l,
                scale: self.scale,
            };
            // SAFETY: (caller) `out` is q-sized and this item's (row, head) slices are ours;
            // the offsets stay inside the checked sizes.
            unsafe { kernel(&job, out.add(start * row_len + head * l.head_dim)) };
            item += heads;
        }
    }
}

/// One sequence's consecutive heads `heads` that read KV head `kv_head`: q_len query rows each.
/// `q` starts at row 0 of the first head; head m's row j is at m * head_dim + j * row_stride.
#[derive(Clone, Copy)]
struct Head<'a> {
    q: &'a [f32],
    row_stride: usize,
    kv_cache: &'a [f32],
    kv_head: usize,
    heads: usize,
    table: &'a [i32],
    q_len: usize,
    k_len: usize,
    layout: Layout,
    scale: f32,
}

impl<'a> Head<'a> {
    /// The job of head m alone.
    fn one(&self, m: usize) -> Head<'a> {
        Head {
            q: &self.q[m * self.layout.head_dim..],
            heads: 1,
            ..*self
        }
    }
}

type Kernel = unsafe fn(&Head, *mut f32);

/// The widest variant this CPU runs; all compute the same operations.
fn select() -> Kernel {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return head_avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return head_avx2;
        }
    }
    head_portable
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn head_avx512(job: &Head, out: *mut f32) {
    // R rows at a time: R * head_dim / 16 accumulators stay in registers (16 of 32)
    match job.layout.head_dim {
        64 => avx512::heads::<4, 4>(job, out),
        128 => avx512::heads::<8, 2>(job, out),
        _ => by_head_dim(job, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn head_avx2(job: &Head, out: *mut f32) {
    // R rows at a time: R * head_dim / 8 accumulators in registers (of 16)
    match job.layout.head_dim {
        64 => avx2::heads::<4, 2>(job, out),
        128 => avx2::heads::<8, 1>(job, out),
        _ => by_head_dim(job, out),
    }
}

unsafe fn head_portable(job: &Head, out: *mut f32) {
    by_head_dim(job, out)
}

/// Common head sizes get a copy compiled for their size (the accumulator stays in registers);
/// the arithmetic is the same in every copy.
#[inline(always)]
unsafe fn by_head_dim(job: &Head, out: *mut f32) {
    for m in 0..job.heads {
        let (one, out) = (job.one(m), out.add(m * job.layout.head_dim));
        match job.layout.head_dim {
            64 => head::<64>(&one, out),
            128 => head::<128>(&one, out),
            _ => head::<0>(&one, out),
        }
    }
}

/// Online softmax over the keys of each query row of one (sequence, head): `job.heads` is 1.
///
/// Keys go in runs of up to LANES consecutive positions inside one cache block; a run's
/// scores are exponentiated together against the running maximum. Runs start at fixed
/// positions (multiples of LANES and of block_size), whichever row is being computed.
/// SAFETY (caller): `out` points at row 0 of this head, with `row_stride` floats between rows,
/// and `q_len` rows of `head_dim` floats are writable there.
/// DIM: the head_dim this copy is compiled for, 0 = any (read from the layout).
#[inline(always)]
unsafe fn head<const DIM: usize>(job: &Head, out: *mut f32) {
    let l = &job.layout;
    let (d, bs) = (if DIM == 0 { l.head_dim } else { DIM }, l.block_size);
    let token_stride = l.num_kv_heads * d; // floats between consecutive slots
    let v_offset = l.num_blocks * bs * token_stride; // V half of the cache
    let mut acc = [0f32; MAX_HEAD_DIM];
    let mut scores = [0f32; LANES];
    for j in 0..job.q_len {
        let query = &job.q[j * job.row_stride..][..d];
        let keys = job.k_len - job.q_len + j + 1; // positions 0..=k - q + j
        let acc = &mut acc[..d];
        acc.fill(0.0);
        let (mut max, mut sum) = (f32::NEG_INFINITY, 0f32);
        let mut t = 0;
        while t < keys {
            let offset = t % bs;
            let n = (bs - offset).min(keys - t).min(LANES - t % LANES);
            let first = (job.table[t / bs] as usize * bs + offset) * token_stride + job.kv_head * d;
            for (i, score) in scores[..n].iter_mut().enumerate() {
                let key = &job.kv_cache[first + i * token_stride..][..d];
                *score = dot(query, key) * job.scale;
            }
            let run_max = scores[..n].iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            if run_max > max {
                if sum > 0.0 {
                    // rescale what was summed against the old maximum
                    let shrink = exp_nonpositive(max - run_max);
                    sum *= shrink;
                    acc.iter_mut().for_each(|a| *a *= shrink);
                }
                max = run_max;
            }
            // all lanes at once (vectorised); lanes >= n hold stale scores and are not read
            let mut weights = [0f32; LANES];
            for (w, s) in weights.iter_mut().zip(&scores) {
                *w = exp_nonpositive(s - max);
            }
            for (i, &w) in weights[..n].iter().enumerate() {
                let value = &job.kv_cache[v_offset + first + i * token_stride..][..d];
                sum += w;
                acc.iter_mut().zip(value).for_each(|(a, v)| *a += w * v);
            }
            t += n;
        }
        let dst = std::slice::from_raw_parts_mut(out.add(j * job.row_stride), d);
        dst.iter_mut()
            .zip(acc.iter())
            .for_each(|(o, a)| *o = a / sum);
    }
}

// The constants of `exp_nonpositive`, shared with its 16-lane copy `avx512::exp16`.
const EXP_MIN: f32 = -87.0; // below: 0
const LN2_HI: f32 = 0.693_359_4; // ln 2 split so that n * LN2_HI is exact
const LN2_LO: f32 = -2.121_944_4e-4;
const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
/// P(r) = ((((c0 r + c1) r + c2) r + c3) r + c4) r + c5, Cephes expf's polynomial.
const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// e^x for x <= 0 with a relative error of a few 1e-7 (0 below -87.3), as plain arithmetic that
/// vectorises: x = n ln2 + r, |r| <= ln2 / 2, e^x = 2^n * (P(r) r^2 + r + 1).
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    let clamped = x.clamp(EXP_MIN, 0.0);
    let n = (clamped * std::f32::consts::LOG2_E + ROUND) - ROUND;
    let r = clamped - n * LN2_HI - n * LN2_LO;
    let mut p = EXP_POLY[0] * r + EXP_POLY[1];
    for c in &EXP_POLY[2..] {
        p = p * r + c;
    }
    let e = p * r * r + r + 1.0;
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23); // 2^n, n in [-126, 0]
    if x < EXP_MIN {
        0.0
    } else {
        e * scale
    }
}

/// One pass of the SIMD copies (`avx512::heads`, `avx2::heads`) over up to R of a job's rows:
/// row x is (query row j, head m), and rows of one j share their keys. The pass walks the keys
/// of its longest row in `head`'s runs; a row's own runs are the same ones, cut at its own
/// last key.
#[cfg(target_arch = "x86_64")]
struct Pass<'a, const R: usize> {
    job: &'a Head<'a>,
    d: usize,
    keys: [usize; R],    // keys of row r: positions 0..keys[r]
    at: [usize; R],      // offset of row r in q and out
    longest: usize,      // the most keys of a row
    token_stride: usize, // floats between consecutive slots
    v_offset: usize,     // the V half of the cache
}

#[cfg(target_arch = "x86_64")]
impl<'a, const R: usize> Pass<'a, R> {
    /// Rows first_row..first_row + rows of `job` (rows <= R), head_dim d.
    #[inline(always)]
    fn new(job: &'a Head<'a>, d: usize, first_row: usize, rows: usize) -> Self {
        let l = &job.layout;
        let (mut keys, mut at) = ([0usize; R], [0usize; R]);
        for r in 0..rows {
            let (j, m) = ((first_row + r) / job.heads, (first_row + r) % job.heads);
            keys[r] = job.k_len - job.q_len + j + 1;
            at[r] = m * d + j * job.row_stride;
        }
        let token_stride = l.num_kv_heads * d;
        Pass {
            job,
            d,
            keys,
            at,
            longest: keys[..rows].iter().copied().max().unwrap_or(0),
            token_stride,
            v_offset: l.num_blocks * l.block_size * token_stride,
        }
    }

    /// The run of keys starting at position t: (offset in the cache of its first key, its
    /// length: up to the end of t's block and of t's group of LANES keys).
    #[inline(always)]
    fn run(&self, t: usize) -> (usize, usize) {
        let (job, bs) = (self.job, self.job.layout.block_size);
        let first =
            (job.table[t / bs] as usize * bs + t % bs) * self.token_stride + job.kv_head * self.d;
        (
            first,
            (bs - t % bs).min(self.longest - t).min(LANES - t % LANES),
        )
    }

    /// Prefetches the keys and values of the run at position t, if the pass has one, into L2:
    /// it may sit in another block (anywhere in the cache, where no hardware prefetcher looks),
    /// so it is asked for while the current run computes (a prefetch changes no result).
    /// Measured (one layer of SmolLM2's shape, 2 threads, AVX-512): a decode step of 64
    /// sequences of 600 tokens 5.6-5.7 -> 4.1-4.2 ms, one sequence of 2,000 tokens 297-343 ->
    /// 225-233 µs; into L1 no faster than none.
    #[inline(always)]
    fn prefetch_next(&self, t: usize) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        if t >= self.longest {
            return;
        }
        let (first, n) = self.run(t);
        let cache = self.job.kv_cache.as_ptr();
        for i in 0..n {
            // LANES float32 = one 64-byte cache line
            for line in (0..self.d).step_by(LANES) {
                let key = cache.wrapping_add(first + i * self.token_stride + line);
                // SAFETY: a prefetch reads nothing and cannot fault
                unsafe {
                    _mm_prefetch::<_MM_HINT_T1>(key as *const i8);
                    _mm_prefetch::<_MM_HINT_T1>(key.wrapping_add(self.v_offset) as *const i8);
                }
            }
        }
    }
}

/// `head` written with AVX-512 intrinsics for head_dim = 16 * NV, R rows of a job at a time
/// (see the module doc). Every operation of a row mirrors the generic one, in the same order:
/// mul then add (never fused), `dot`'s lane reduction and `exp_nonpositive`.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use super::{exp_nonpositive, Head, Pass, EXP_MIN, EXP_POLY, LANES, LN2_HI, LN2_LO, ROUND};
    use std::arch::x86_64::*;

    /// Levels 1-2 of `dot`'s reduction for the 16-lane products of keys a, b, c, d: 128-bit
    /// chunk c of the result holds key c's four sums h[i] + h[i + 4], h[i] = x[i] + x[i + 8].
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn reduce4(a: __m512, b: __m512, c: __m512, d: __m512) -> __m512 {
        // [a0..7 + a8..15, b0..7 + b8..15]
        let ab = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
        );
        let cd = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(c, d),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(c, d),
        );
        // chunks [a, b, c, d] of ab, cd's low halves + their high halves
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(ab, cd),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(ab, cd),
        )
    }

    /// Levels 3-4: 16 keys' scores (q0 + q2) + (q1 + q3) from four `reduce4` results (keys
    /// 4p..4p+3 in z[p]); lane s of the result is key s.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn reduce16(z: &[__m512; 4]) -> __m512 {
        // chunk c: [q0 + q2, q1 + q3] of key c (of 8r + c), then of key 4 + c (of 8r + 4 + c)
        let w0 = _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(z[0], z[1]),
            _mm512_shuffle_ps::<0xEE>(z[0], z[1]),
        );
        let w1 = _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(z[2], z[3]),
            _mm512_shuffle_ps::<0xEE>(z[2], z[3]),
        );
        // lane 4c + m holds key 4m + c: transpose back
        let v = _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(w0, w1),
            _mm512_shuffle_ps::<0xDD>(w0, w1),
        );
        let order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
        _mm512_permutexvar_ps(order, v)
    }

    /// `exp_nonpositive` on 16 lanes, operation for operation (the clamp as compare + move).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn exp16(x: __m512) -> __m512 {
        let c = _mm512_set1_ps;
        let (low, zero, round) = (c(EXP_MIN), _mm512_setzero_ps(), c(ROUND));
        let below = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, low);
        let clamped = _mm512_mask_mov_ps(x, below, low);
        let clamped = _mm512_mask_mov_ps(
            clamped,
            _mm512_cmp_ps_mask::<_CMP_GT_OQ>(clamped, zero),
            zero,
        );
        let scaled = _mm512_mul_ps(clamped, c(std::f32::consts::LOG2_E));
        let n = _mm512_sub_ps(_mm512_add_ps(scaled, round), round);
        let r = _mm512_sub_ps(
            _mm512_sub_ps(clamped, _mm512_mul_ps(n, c(LN2_HI))),
            _mm512_mul_ps(n, c(LN2_LO)),
        );
        let mut p = _mm512_add_ps(_mm512_mul_ps(c(EXP_POLY[0]), r), c(EXP_POLY[1]));
        for &k in &EXP_POLY[2..] {
            p = _mm512_add_ps(_mm512_mul_ps(p, r), c(k));
        }
        let e = _mm512_add_ps(
            _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r),
            c(1.0),
        );
        let exponent = _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127));
        let two_n = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(exponent));
        _mm512_mask_mov_ps(_mm512_mul_ps(e, two_n), below, zero)
    }

    /// The rows of `job` (its heads' query rows), R at a time. A pass walks the keys of its
    /// longest row in `head`'s runs; a row's own runs are the same ones, cut at its own last key.
    /// SAFETY (caller): as for `head`, for each of the job's heads at `out` + m * head_dim.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn heads<const NV: usize, const R: usize>(job: &Head, out: *mut f32) {
        let d = NV * LANES;
        debug_assert_eq!(d, job.layout.head_dim);
        let cache = job.kv_cache.as_ptr();
        let scale = _mm512_set1_ps(job.scale);
        let rows_total = job.heads * job.q_len;
        let mut first_row = 0;
        while first_row < rows_total {
            let rows = R.min(rows_total - first_row);
            let pass = Pass::<R>::new(job, d, first_row, rows);
            let (keys, at, longest) = (pass.keys, pass.at, pass.longest);
            let (token_stride, v_offset) = (pass.token_stride, pass.v_offset);
            let mut acc = [[_mm512_setzero_ps(); NV]; R];
            let mut max = [f32::NEG_INFINITY; R];
            let mut sum = [0f32; R];
            let mut weights = [[0f32; LANES]; R];
            let mut t = 0;
            while t < longest {
                // in bounds: `check` validated the block id and the cache size
                let (first, n) = pass.run(t);
                pass.prefetch_next(t + n);
                let mut count = [0usize; R]; // keys of this run that row r sees
                for r in 0..rows {
                    count[r] = n.min(keys[r].saturating_sub(t));
                    let seen = count[r];
                    if seen == 0 {
                        continue;
                    }
                    let query = job.q[at[r]..][..d].as_ptr();
                    let mut qv = [_mm512_setzero_ps(); NV];
                    for (c, v) in qv.iter_mut().enumerate() {
                        *v = _mm512_loadu_ps(query.add(c * LANES));
                    }
                    // lane products of each key, 0 for keys past `seen` (never read)
                    let mut z = [_mm512_setzero_ps(); 4];
                    for (p, zp) in z.iter_mut().enumerate().take(seen.div_ceil(4)) {
                        let mut prod = [_mm512_setzero_ps(); 4];
                        for (i, lanes) in prod.iter_mut().enumerate() {
                            if 4 * p + i < seen {
                                let key = cache.add(first + (4 * p + i) * token_stride);
                                for (c, q) in qv.iter().enumerate() {
                                    let k = _mm512_loadu_ps(key.add(c * LANES));
                                    *lanes = _mm512_add_ps(*lanes, _mm512_mul_ps(*q, k));
                                }
                            }
                        }
                        *zp = reduce4(prod[0], prod[1], prod[2], prod[3]);
                    }
                    let scores = _mm512_mul_ps(reduce16(&z), scale);
                    let valid = (u32::MAX >> (32 - seen)) as __mmask16;
                    let run_max = _mm512_mask_reduce_max_ps(valid, scores);
                    if run_max > max[r] {
                        if sum[r] > 0.0 {
                            // rescale what was summed against the old maximum
                            let shrink = exp_nonpositive(max[r] - run_max);
                            sum[r] *= shrink;
                            let s = _mm512_set1_ps(shrink);
                            acc[r].iter_mut().for_each(|a| *a = _mm512_mul_ps(*a, s));
                        }
                        max[r] = run_max;
                    }
                    let w = exp16(_mm512_sub_ps(scores, _mm512_set1_ps(max[r])));
                    _mm512_storeu_ps(weights[r].as_mut_ptr(), w);
                }
                // i indexes the value rows and every row's weights
                #[allow(clippy::needless_range_loop)]
                for i in 0..n {
                    let value = cache.add(v_offset + first + i * token_stride);
                    let mut v = [_mm512_setzero_ps(); NV];
                    for (c, vc) in v.iter_mut().enumerate() {
                        *vc = _mm512_loadu_ps(value.add(c * LANES));
                    }
                    for r in 0..rows {
                        if i < count[r] {
                            let w = weights[r][i];
                            sum[r] += w;
                            let wv = _mm512_set1_ps(w);
                            for (a, vc) in acc[r].iter_mut().zip(&v) {
                                *a = _mm512_add_ps(*a, _mm512_mul_ps(wv, *vc));
                            }
                        }
                    }
                }
                t += n;
            }
            for r in 0..rows {
                let total = _mm512_set1_ps(sum[r]);
                let dst = out.add(at[r]);
                for (c, a) in acc[r].iter().enumerate() {
                    _mm512_storeu_ps(dst.add(c * LANES), _mm512_div_ps(*a, total));
                }
            }
            first_row += rows;
        }
    }
}

/// `avx512::heads` for AVX2 CPUs: a 16-lane chunk of a row is two 8-lane halves (lanes 0-7,
/// 8-15), and 8 keys' scores are reduced together; every operation of a row mirrors the
/// generic `head` in the same order (mul then add, never fused; `dot`'s lane reduction;
/// `exp_nonpositive`), so the results are its bits.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{exp_nonpositive, Head, Pass, EXP_MIN, EXP_POLY, LANES, LN2_HI, LN2_LO, ROUND};
    use std::arch::x86_64::*;

    /// Levels 2-4 of `dot`'s reduction for 8 keys, given level 1 (h[i] = x[i] + x[i + 8],
    /// 8 lanes per key): lane s of the result is key s's (q0 + q2) + (q1 + q3), where
    /// q[i] = h[i] + h[i + 4].
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn reduce8(h: &[__m256; 8]) -> __m256 {
        // [q of key a | q of key b]
        let pair = |a: __m256, b: __m256| {
            _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(a, b),
                _mm256_permute2f128_ps::<0x31>(a, b),
            )
        };
        // keys (a, b, c, d) from [qa | qb], [qc | qd]: [a02, a13, c02, c13 | b02, b13, d02, d13]
        let four = |ab: __m256, cd: __m256| {
            _mm256_add_ps(
                _mm256_shuffle_ps::<0x44>(ab, cd),
                _mm256_shuffle_ps::<0xEE>(ab, cd),
            )
        };
        let x0 = four(pair(h[0], h[1]), pair(h[2], h[3]));
        let x1 = four(pair(h[4], h[5]), pair(h[6], h[7]));
        // [k0, k2, k4, k6 | k1, k3, k5, k7]
        let y = _mm256_add_ps(
            _mm256_shuffle_ps::<0x88>(x0, x1),
            _mm256_shuffle_ps::<0xDD>(x0, x1),
        );
        _mm256_permutevar8x32_ps(y, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
    }

    /// `exp_nonpositive` on 8 lanes, operation for operation (the clamp as compare + blend).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn exp8(x: __m256) -> __m256 {
        let c = _mm256_set1_ps;
        let (low, zero, round) = (c(EXP_MIN), _mm256_setzero_ps(), c(ROUND));
        let below = _mm256_cmp_ps::<_CMP_LT_OQ>(x, low);
        let clamped = _mm256_blendv_ps(x, low, below);
        let clamped = _mm256_blendv_ps(clamped, zero, _mm256_cmp_ps::<_CMP_GT_OQ>(clamped, zero));
        let scaled = _mm256_mul_ps(clamped, c(std::f32::consts::LOG2_E));
        let n = _mm256_sub_ps(_mm256_add_ps(scaled, round), round);
        let r = _mm256_sub_ps(
            _mm256_sub_ps(clamped, _mm256_mul_ps(n, c(LN2_HI))),
            _mm256_mul_ps(n, c(LN2_LO)),
        );
        let mut p = _mm256_add_ps(_mm256_mul_ps(c(EXP_POLY[0]), r), c(EXP_POLY[1]));
        for &k in &EXP_POLY[2..] {
            p = _mm256_add_ps(_mm256_mul_ps(p, r), c(k));
        }
        let e = _mm256_add_ps(
            _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r),
            c(1.0),
        );
        let exponent = _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127));
        let two_n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(exponent));
        _mm256_blendv_ps(_mm256_mul_ps(e, two_n), zero, below)
    }

    /// The rows of `job` (its heads' query rows), R at a time, head_dim = 16 * NV, walked as
    /// in `avx512::heads` (the runs of the longest row, cut at each row's own last key).
    /// SAFETY (caller): as for `head`, for each of the job's heads at `out` + m * head_dim.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn heads<const NV: usize, const R: usize>(job: &Head, out: *mut f32) {
        let d = NV * LANES;
        debug_assert_eq!(d, job.layout.head_dim);
        let cache = job.kv_cache.as_ptr();
        let scale = _mm256_set1_ps(job.scale);
        let rows_total = job.heads * job.q_len;
        let mut first_row = 0;
        while first_row < rows_total {
            let rows = R.min(rows_total - first_row);
            let pass = Pass::<R>::new(job, d, first_row, rows);
            let (keys, at, longest) = (pass.keys, pass.at, pass.longest);
            let (token_stride, v_offset) = (pass.token_stride, pass.v_offset);
            // acc[r][2c + h]: half h of 16-lane chunk c of row r's weighted values
            let mut acc = [[[_mm256_setzero_ps(); 2]; NV]; R];
            let mut max = [f32::NEG_INFINITY; R];
            let mut sum = [0f32; R];
            let mut weights = [[0f32; LANES]; R];
            let mut t = 0;
            while t < longest {
                let (first, n) = pass.run(t);
                pass.prefetch_next(t + n);
                let mut count = [0usize; R];
                for r in 0..rows {
                    count[r] = n.min(keys[r].saturating_sub(t));
                    let seen = count[r];
                    if seen == 0 {
                        continue;
                    }
                    let query = job.q[at[r]..][..d].as_ptr();
                    let mut scores = [0f32; LANES];
                    for (g, group) in scores
                        .chunks_exact_mut(8)
                        .enumerate()
                        .take(seen.div_ceil(8))
                    {
                        // level 1 of each key's reduction; 0 for keys past `seen` (never read)
                        let mut h = [_mm256_setzero_ps(); 8];
                        for (i, hi) in h.iter_mut().enumerate() {
                            if 8 * g + i >= seen {
                                break;
                            }
                            let key = cache.add(first + (8 * g + i) * token_stride);
                            let (mut lo, mut up) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                            for c in 0..NV {
                                let (qc, kc) = (query.add(c * LANES), key.add(c * LANES));
                                lo = _mm256_add_ps(
                                    lo,
                                    _mm256_mul_ps(_mm256_loadu_ps(qc), _mm256_loadu_ps(kc)),
                                );
                                up = _mm256_add_ps(
                                    up,
                                    _mm256_mul_ps(
                                        _mm256_loadu_ps(qc.add(8)),
                                        _mm256_loadu_ps(kc.add(8)),
                                    ),
                                );
                            }
                            *hi = _mm256_add_ps(lo, up);
                        }
                        _mm256_storeu_ps(group.as_mut_ptr(), _mm256_mul_ps(reduce8(&h), scale));
                    }
                    let run_max = scores[..seen]
                        .iter()
                        .fold(f32::NEG_INFINITY, |m, &s| m.max(s));
                    if run_max > max[r] {
                        if sum[r] > 0.0 {
                            // rescale what was summed against the old maximum
                            let shrink = exp_nonpositive(max[r] - run_max);
                            sum[r] *= shrink;
                            let s = _mm256_set1_ps(shrink);
                            for a in acc[r].iter_mut().flatten() {
                                *a = _mm256_mul_ps(*a, s);
                            }
                        }
                        max[r] = run_max;
                    }
                    let m = _mm256_set1_ps(max[r]);
                    for (w, s) in weights[r].chunks_exact_mut(8).zip(scores.chunks_exact(8)) {
                        let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s.as_ptr()), m));
                        _mm256_storeu_ps(w.as_mut_ptr(), e);
                    }
                }
                #[allow(clippy::needless_range_loop)]
                for i in 0..n {
                    let value = cache.add(v_offset + first + i * token_stride);
                    for r in 0..rows {
                        if i < count[r] {
                            let w = weights[r][i];
                            sum[r] += w;
                            let wv = _mm256_set1_ps(w);
                            for (c, a) in acc[r].iter_mut().enumerate() {
                                let vc = value.add(c * LANES);
                                a[0] = _mm256_add_ps(a[0], _mm256_mul_ps(wv, _mm256_loadu_ps(vc)));
                                a[1] = _mm256_add_ps(
                                    a[1],
                                    _mm256_mul_ps(wv, _mm256_loadu_ps(vc.add(8))),
                                );
                            }
                        }
                    }
                }
                t += n;
            }
            for r in 0..rows {
                let total = _mm256_set1_ps(sum[r]);
                let dst = out.add(at[r]);
                for (c, a) in acc[r].iter().enumerate() {
                    _mm256_storeu_ps(dst.add(c * LANES), _mm256_div_ps(a[0], total));
                    _mm256_storeu_ps(dst.add(c * LANES + 8), _mm256_div_ps(a[1], total));
                }
            }
            first_row += rows;
        }
    }
}

/// sum_t a[t] * b[t] over LANES partial sums, reduced in a fixed order.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; LANES];
    let full = a.len() / LANES * LANES;
    for (x, y) in a[..full]
        .chunks_exact(LANES)
        .zip(b[..full].chunks_exact(LANES))
    {
        let (x, y): (&[f32; LANES], &[f32; LANES]) = (x.try_into().unwrap(), y.try_into().unwrap());
        for i in 0..LANES {
            lanes[i] += x[i] * y[i];
        }
    }
    if full < a.len() {
        // the tail as one zero-padded chunk: the same operations as a full one
        let (mut x, mut y) = ([0f32; LANES], [0f32; LANES]);
        x[..a.len() - full].copy_from_slice(&a[full..]);
        y[..a.len() - full].copy_from_slice(&b[full..]);
        for i in 0..LANES {
            lanes[i] += x[i] * y[i];
        }
    }
    // pairwise: lane i + lane i + 8, then + 4, + 2, + 1
    let mut half = [0f32; 8];
    for i in 0..8 {
        half[i] = lanes[i] + lanes[i + 8];
    }
    let quarter = [
        half[0] + half[4],
        half[1] + half[5],
        half[2] + half[6],
        half[3] + half[7],
    ];
    (quarter[0] + quarter[2]) + (quarter[1] + quarter[3])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::values;

    /// Dense float64 attention of one query row against explicit key/value rows.
    fn reference(query: &[f32], keys: &[&[f32]], values: &[&[f32]], scale: f64) -> Vec<f64> {
        let scores: Vec<f64> = keys
            .iter()
            .map(|k| {
                query
                    .iter()
                    .zip(*k)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
                    * scale
            })
            .collect();
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        (0..query.len())
            .map(|c| {
                weights
                    .iter()
                    .zip(values)
                    .map(|(w, v)| w * v[c] as f64)
                    .sum::<f64>()
                    / total
            })
            .collect()
    }

    struct Case {
        layout: Layout,
        cu: Vec<i32>,
        lens: Vec<i32>,
        tables: Vec<i32>,
        cache: Vec<f32>,
        q: Vec<f32>,
    }

    /// Sequences with `(q_len, k_len)`, their blocks scattered over the cache in reverse.
    fn case(seqs: &[(usize, usize)], hq: usize, hkv: usize, d: usize, bs: usize) -> Case {
        let max_blocks = seqs.iter().map(|s| s.1.div_ceil(bs)).max().unwrap() + 1;
        let num_blocks = seqs.len() * max_blocks + 3;
        let mut tables = vec![0; seqs.len() * max_blocks];
        let mut next = num_blocks as i32;
        for (i, _) in seqs.iter().enumerate() {
            for c in 0..max_blocks {
                next -= 1;
                tables[i * max_blocks + c] = next;
            }
        }
        let mut cu = vec![0];
        for s in seqs {
            cu.push(cu.last().unwrap() + s.0 as i32);
        }
        let layout = Layout {
            num_heads: hq,
            num_kv_heads: hkv,
            head_dim: d,
            block_size: bs,
            num_blocks,
            max_blocks,
        };
        Case {
            layout,
            lens: seqs.iter().map(|s| s.1 as i32).collect(),
            cache: values(2 * num_blocks * bs * hkv * d, 7),
            q: values(*cu.last().unwrap() as usize * hq * d, 8)
                .iter()
                .map(|v| v * 4.0)
                .collect(),
            cu,
            tables,
        }
    }

    impl Case {
        fn step(&self) -> Step<'_> {
            Step {
                cu_seqlens_q: &self.cu,
                seq_lens: &self.lens,
                block_tables: &self.tables,
            }
        }

        fn run(&self, threads: usize) -> Vec<f32> {
            let mut out = vec![f32::NAN; self.q.len()];
            // min_macs 0: every call is split into `threads` parts
            attend_split(
                &self.q,
                &self.cache,
                &mut out,
                &self.layout,
                &self.step(),
                0.125,
                threads,
                0,
            )
            .unwrap();
            out
        }

        fn key(&self, seq: usize, pos: usize, kv_head: usize, half: usize) -> &[f32] {
            let l = &self.layout;
            let block = self.tables[seq * l.max_blocks + pos / l.block_size] as usize;
            let slot =
                half * l.num_blocks * l.block_size + block * l.block_size + pos % l.block_size;
            let at = (slot * l.num_kv_heads + kv_head) * l.head_dim;
            &self.cache[at..at + l.head_dim]
        }
    }

    #[test]
    fn matches_dense_float64_attention() {
        // decode, verify, a short prefill and GQA; head_dim with and without a lane tail
        for &(hq, hkv, d, bs) in &[(4, 2, 64, 16), (8, 2, 128, 16), (3, 3, 20, 4), (6, 1, 7, 5)] {
            let c = case(&[(1, 37), (4, 4), (3, 50), (1, 1)], hq, hkv, d, bs);
            for threads in [1, 2, 3] {
                let out = c.run(threads);
                for (seq, (&start, &k)) in c.cu.iter().zip(&c.lens).enumerate() {
                    let q_len = (c.cu[seq + 1] - start) as usize;
                    for j in 0..q_len {
                        let pos = k as usize - q_len + j;
                        for h in 0..hq {
                            let kvh = h / (hq / hkv);
                            let keys: Vec<&[f32]> =
                                (0..=pos).map(|t| c.key(seq, t, kvh, 0)).collect();
                            let vals: Vec<&[f32]> =
                                (0..=pos).map(|t| c.key(seq, t, kvh, 1)).collect();
                            let at = ((start as usize + j) * hq + h) * d;
                            let want = reference(&c.q[at..at + d], &keys, &vals, 0.125);
                            for (got, want) in out[at..at + d].iter().zip(&want) {
                                assert!((*got as f64 - want).abs() < 1e-5, "{hq}/{hkv}/{d}/{bs}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_verify_row_equals_the_decode_row_bit_for_bit() {
        // the last row of a 4-row verify query equals a 1-row decode query at the same position
        let verify = case(&[(4, 40), (2, 9)], 4, 2, 64, 16);
        let mut decode = case(&[(1, 40), (1, 9)], 4, 2, 64, 16);
        let row = 4 * 64;
        decode.q.clear();
        decode.q.extend_from_slice(&verify.q[3 * row..4 * row]);
        decode.q.extend_from_slice(&verify.q[5 * row..6 * row]);
        let (v, dcd) = (verify.run(2), decode.run(1));
        assert_eq!(v[3 * row..4 * row], dcd[..row]);
        assert_eq!(v[5 * row..6 * row], dcd[row..]);
    }

    #[test]
    fn every_cpu_variant_computes_the_same_bits() {
        // head_dim 64 and 128 take the AVX-512 intrinsics, 40 the generic code everywhere. Jobs
        // of 1-3 heads of a GQA group, decode to 16-row verify, runs cut by blocks of 8, 16, 32
        // and by short contexts
        let jobs = [
            (3, 1, 45, 16),
            (2, 3, 45, 16),
            (1, 16, 70, 16),
            (3, 7, 33, 8),
            (3, 4, 100, 32),
            (2, 1, 1, 16),
            (3, 5, 5, 16),
        ];
        for d in [64, 128, 40] {
            for &(heads, q_len, k_len, bs) in &jobs {
                let c = case(&[(q_len, k_len)], 3, 1, d, bs);
                let job = Head {
                    q: &c.q,
                    row_stride: 3 * d,
                    kv_cache: &c.cache,
                    kv_head: 0,
                    heads,
                    table: &c.tables[..k_len.div_ceil(bs)],
                    q_len,
                    k_len,
                    layout: c.layout,
                    scale: 0.3,
                };
                let run = |kernel: Kernel| {
                    let mut out = vec![0.0; c.q.len()];
                    // SAFETY: out holds q_len rows of row_stride floats, heads <= 3 of them
                    unsafe { kernel(&job, out.as_mut_ptr()) };
                    out
                };
                let portable = run(head_portable);
                assert!(portable.iter().any(|v| *v != 0.0));
                let what = format!("head_dim {d}, job {:?}", (heads, q_len, k_len, bs));
                #[cfg(target_arch = "x86_64")]
                {
                    if std::arch::is_x86_feature_detected!("avx2") {
                        assert_eq!(run(head_avx2), portable, "avx2, {what}");
                    }
                    if std::arch::is_x86_feature_detected!("avx512f") {
                        assert_eq!(run(head_avx512), portable, "avx512, {what}");
                    }
                }
            }
        }
    }

    #[test]
    fn results_do_not_depend_on_how_the_call_is_split() {
        // 9 heads over 3 KV heads: 2 or 4 parts cut KV groups, so jobs hold 1-3 heads
        let c = case(&[(1, 300), (4, 77), (2, 16), (1, 1)], 9, 3, 64, 16);
        let whole = c.run(1);
        for threads in [2, 3, 4, 7] {
            assert_eq!(c.run(threads), whole, "{threads} parts");
        }
    }

    #[test]
    fn exp_is_accurate_on_the_nonpositive_half_line() {
        let mut x = 0.0f32;
        while x > -87.0 {
            let (got, want) = (exp_nonpositive(x) as f64, (x as f64).exp());
            assert!(
                (got - want).abs() <= 3e-7 * want,
                "exp({x}) = {got}, want {want}"
            );
            x -= 0.0137;
        }
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpositive(0.0), 1.0);
    }

    #[test]
    fn bad_indices_are_errors_not_reads() {
        let c = case(&[(1, 20)], 2, 1, 8, 4);
        let mut out = vec![0.0; c.q.len()];
        let mut tables = c.tables.clone();
        tables[1] = c.layout.num_blocks as i32;
        let step = Step {
            block_tables: &tables,
            ..c.step()
        };
        let err = attend(&c.q, &c.cache, &mut out, &c.layout, &step, 1.0, 1).unwrap_err();
        assert!(err.contains("block id"), "{err}");
        let lens = [c.layout.max_blocks as i32 * 4 + 1];
        let step = Step {
            seq_lens: &lens,
            ..c.step()
        };
        assert!(attend(&c.q, &c.cache, &mut out, &c.layout, &step, 1.0, 1).is_err());
        let short = &c.cache[1..];
        assert!(attend(&c.q, short, &mut out, &c.layout, &c.step(), 1.0, 1).is_err());
    }
}
