//! The routed MLP of one mixture-of-experts layer for the few rows of a CPU decode or verify
//! step, in one call: the step's (token, slot) pairs grouped by expert, each active expert's
//! gate and up products over all of its rows at once, the gated activation, the down product,
//! and the weighted outputs summed into each token's row.
//!
//! Why native: the Python loop (`model/moe.py` `SparseMoeBlock._grouped`) makes three GEMM
//! calls and several torch ops per active expert, about 100 active experts per layer at batch
//! 32 on a 128-expert top-8 model; here the whole layer is 4 parallel regions of the OpenMP team
//! (`omp`) whatever the number of experts.
//!
//! Numerics: the same products as `small_gemm` / `int8_gemm` (so the same bits as the Python
//! path's NativeLinear calls), a bias added after its product, the output times the slot's
//! weight, and each token's row the sum, starting from zero, of its slots' weighted outputs in
//! ascending expert order (slots of one expert in slot order): `_grouped`'s order. Every step
//! is per row, so a row's result does not depend on which other rows share the call: a verify
//! step reproduces the decode step bit for bit.
//!
//! Threading: the work of each product phase is split into tasks of (product, block of output
//! columns: `Plan::column_block`, `auto_block`), taken in turn by the threads of one parallel
//! region (`omp::run_tasks`).

use std::sync::OnceLock;

use crate::cpu::int8_gemm::{self, Activations, QuantizedRows};
use crate::cpu::omp;
use crate::cpu::quant::WeightType;
use crate::cpu::small_gemm::{self as gemm, Geometry, MAX_ROWS};

mod activation;
pub use activation::Activation;

/// One weight matrix [n, k] of an expert: n rows of `ty.row_bytes(k)` bytes, its bias [n].
#[derive(Clone, Copy)]
pub struct Matrix<'a> {
    pub ty: WeightType,
    pub w: &'a [u8],
    pub bias: Option<&'a [f32]>,
}

/// An expert's gate [inner, hidden], up [inner, hidden] and down [hidden, inner].
#[derive(Clone, Copy)]
pub struct Expert<'a> {
    pub gate: Matrix<'a>,
    pub up: Matrix<'a>,
    pub down: Matrix<'a>,
}

/// The step's routing: slot j of token t chose expert `ids[t * k + j]`, weighted by
/// `weights[t * k + j]`.
pub struct Routing<'a> {
    pub ids: &'a [i64],
    pub weights: &'a [f32],
    pub k: usize,
}

/// How a call runs: on up to `threads` threads of libgomp's team, output columns handed out in
/// blocks of `column_block` (0: `auto_block`), block-format products taking x as `acts` says.
#[derive(Clone, Copy)]
pub struct Plan {
    pub threads: usize,
    pub column_block: usize,
    pub acts: Activations,
}

/// A layer's sizes: hidden (the rows' width) and inner (an expert's intermediate size).
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub hidden: usize,
    pub inner: usize,
}

/// Why a call's arguments are not a layer's step (sizes, expert ids, weight formats), or Ok.
pub fn check(
    x_len: usize,
    out_len: usize,
    dims: Dims,
    experts: &[Expert],
    routing: &Routing,
) -> Result<(), String> {
    let Dims { hidden, inner } = dims;
    let (ids, k) = (routing.ids, routing.k);
    if hidden == 0 || inner == 0 || k == 0 || ids.is_empty() || !ids.len().is_multiple_of(k) {
        return Err(format!(
            "hidden {hidden}, inner {inner}, k {k}, {} ids",
            ids.len()
        ));
    }
    let tokens = ids.len() / k;
    if routing.weights.len() != ids.len() || x_len != tokens * hidden || out_len != x_len {
        return Err(format!(
            "{tokens} tokens of {k} slots: need {} weights and x, out of {} values",
            ids.len(),
            tokens * hidden
        ));
    }
    if let Some(bad) = ids.iter().find(|&&e| e < 0 || e as usize >= experts.len()) {
        return Err(format!("expert id {bad} outside 0..{}", experts.len()));
    }
    for (e, ex) in experts.iter().enumerate() {
        for (name, m, (n, kk)) in [
            ("gate", ex.gate, (inner, hidden)),
            ("up", ex.up, (inner, hidden)),
            ("down", ex.down, (hidden, inner)),
        ] {
            let fits = m.ty.row_bytes(kk).is_some_and(|rb| m.w.len() == n * rb);
            if !fits || m.bias.is_some_and(|b| b.len() != n) {
                return Err(format!(
                    "expert {e} {name}: {:?} [{n}, {kk}] needs k a whole number of blocks, \
                     {n} rows and a bias of {n}",
                    m.ty
                ));
            }
        }
    }
    Ok(())
}

/// out [T, hidden] = the routed MLP of x [T, hidden] (module header). Panics where `check`
/// fails or the CPU cannot run the kernels (`small_gemm::available`).
pub fn forward(
    x: &[f32],
    out: &mut [f32],
    dims: Dims,
    experts: &[Expert],
    routing: &Routing,
    act: Activation,
    plan: Plan,
) {
    if let Err(e) = check(x.len(), out.len(), dims, experts, routing) {
        panic!("moe: {e}");
    }
    let step = Step::group(routing, dims);
    SCRATCH.with_borrow_mut(|scratch| {
        let bufs = Buffers::new(scratch, step.order.len(), dims);
        step.run(x, out, experts, &bufs, act, plan);
    });
}

thread_local! {
    /// The calling thread's scratch, reused across calls (no page faults per layer).
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Rows one expert computes together: pairs `start..start + rows` of the step's order
/// (at most MAX_ROWS: an expert with more rows has several segments).
struct Segment {
    expert: usize,
    start: usize,
    rows: usize,
}

/// A step's pairs grouped by expert.
struct Step {
    dims: Dims,
    k: usize,
    /// Pair indices t * k + j sorted by expert, stably (an expert's slots in token order).
    order: Vec<usize>,
    /// The weight of each pair of `order`.
    weights: Vec<f32>,
    segments: Vec<Segment>,
}

/// The step's rows in expert order (P = pairs): x gathered [P, hidden], gate and up
/// [P, inner] (gate then holds the activation), the weighted outputs [P, hidden]. Addresses,
/// so that parallel tasks may write disjoint parts.
struct Buffers {
    xs: usize,
    gate: usize,
    up: usize,
    ys: usize,
}

impl Buffers {
    fn new(scratch: &mut Vec<f32>, pairs: usize, d: Dims) -> Self {
        let (xh, xi) = (pairs * d.hidden, pairs * d.inner);
        let need = 2 * xh + 2 * xi;
        if scratch.len() < need {
            scratch.resize(need, 0.0);
        }
        let base = scratch.as_mut_ptr() as usize;
        let f = std::mem::size_of::<f32>();
        Buffers {
            xs: base,
            gate: base + xh * f,
            up: base + (xh + xi) * f,
            ys: base + (xh + 2 * xi) * f,
        }
    }
}

impl Step {
    fn group(routing: &Routing, dims: Dims) -> Self {
        let mut order: Vec<usize> = (0..routing.ids.len()).collect();
        order.sort_by_key(|&p| routing.ids[p]); // stable
        let weights = order.iter().map(|&p| routing.weights[p]).collect();
        let mut segments: Vec<Segment> = Vec::new();
        for (i, &p) in order.iter().enumerate() {
            let expert = routing.ids[p] as usize;
            match segments.last_mut() {
                Some(s) if s.expert == expert && s.rows < MAX_ROWS => s.rows += 1,
                _ => segments.push(Segment {
                    expert,
                    start: i,
                    rows: 1,
                }),
            }
        }
        Step {
            dims,
            k: routing.k,
            order,
            weights,
            segments,
        }
    }

    /// The phases: gather (and quantize) x, gate and up, the activation (and quantize), down,
    /// then the sums.
    fn run(
        &self,
        x: &[f32],
        out: &mut [f32],
        experts: &[Expert],
        b: &Buffers,
        act: Activation,
        plan: Plan,
    ) {
        let Dims { hidden, inner } = self.dims;
        let int8 = |m: &Matrix| plan.acts == Activations::Int8 && takes_int8(m.ty);
        let x_q = self.each_segment(plan.threads, b.xs, hidden, |s, rows| {
            for (r, &p) in self.order[s.start..][..s.rows].iter().enumerate() {
                let t = p / self.k;
                rows[r * hidden..][..hidden].copy_from_slice(&x[t * hidden..][..hidden]);
            }
            let e = &experts[s.expert];
            (int8(&e.gate) || int8(&e.up)).then(|| int8_gemm::quantize_rows(rows, hidden))
        });
        let mut products = Vec::with_capacity(2 * self.segments.len());
        for (s, q) in self.segments.iter().zip(&x_q) {
            let e = &experts[s.expert];
            let x = at(b.xs, s.start * hidden);
            products.push(Product::new(
                e.gate,
                s,
                (x, q),
                b.gate,
                (inner, hidden),
                None,
            ));
            products.push(Product::new(e.up, s, (x, q), b.up, (inner, hidden), None));
        }
        run_products(&products, plan);
        let act_q = self.each_segment(plan.threads, b.gate, inner, |s, rows| {
            let up = b.up as *const f32;
            // SAFETY: the segment's up rows, written by the phase before, read only here.
            let up = unsafe { std::slice::from_raw_parts(up.add(s.start * inner), s.rows * inner) };
            for (g, u) in rows.chunks_exact_mut(inner).zip(up.chunks_exact(inner)) {
                act.apply(g, u);
            }
            int8(&experts[s.expert].down).then(|| int8_gemm::quantize_rows(rows, inner))
        });
        let products: Vec<Product> = (self.segments.iter().zip(&act_q))
            .map(|(s, q)| {
                let a = (at(b.gate, s.start * inner), q);
                let scale = Some(&self.weights[s.start..][..s.rows]);
                Product::new(experts[s.expert].down, s, a, b.ys, (hidden, inner), scale)
            })
            .collect();
        run_products(&products, plan);
        self.sum(b.ys, out, plan.threads);
    }

    /// Runs `f(segment, its rows of buf (width w))` for every segment in parallel, collecting
    /// what each returns (a quantized copy of the rows, where a product takes one).
    fn each_segment(
        &self,
        threads: usize,
        buf: usize,
        w: usize,
        f: impl Fn(&Segment, &mut [f32]) -> Option<QuantizedRows> + Sync,
    ) -> Vec<Option<QuantizedRows>> {
        let got: Vec<OnceLock<QuantizedRows>> =
            self.segments.iter().map(|_| OnceLock::new()).collect();
        omp::run_tasks(self.segments.len(), threads, &|i| {
            let s = &self.segments[i];
            // SAFETY: segments own disjoint rows of buf, which holds every pair's row.
            let rows = unsafe {
                std::slice::from_raw_parts_mut((buf as *mut f32).add(s.start * w), s.rows * w)
            };
            if let Some(q) = f(s, rows) {
                let _ = got[i].set(q);
            }
        });
        got.into_iter().map(OnceLock::into_inner).collect()
    }

    /// out[t] = 0 + its pairs' weighted outputs in the order's (ascending expert) order, in
    /// parallel over blocks of columns.
    fn sum(&self, ys: usize, out: &mut [f32], threads: usize) {
        let hidden = self.dims.hidden;
        let blocks = if self.order.len() * hidden < 1 << 15 {
            1
        } else {
            threads.clamp(1, hidden.div_ceil(256))
        };
        let per = hidden.div_ceil(blocks);
        let op = out.as_mut_ptr() as usize;
        out.fill(0.0);
        omp::run(blocks, &|blk| {
            let cols = (blk * per).min(hidden)..((blk + 1) * per).min(hidden);
            for (i, &p) in self.order.iter().enumerate() {
                let t = p / self.k;
                // SAFETY: blocks write disjoint columns of out [T, hidden]; ys holds a row per
                // pair, all written by the down phase.
                unsafe {
                    let dst = (op as *mut f32).add(t * hidden);
                    let src = (ys as *const f32).add(i * hidden);
                    for c in cols.clone() {
                        *dst.add(c) += *src.add(c);
                    }
                }
            }
        });
    }
}

/// The address `floats` float32 values past `base`.
fn at(base: usize, floats: usize) -> usize {
    base + floats * std::mem::size_of::<f32>()
}

/// Whether a product with weights of `ty` takes the integer path when asked (as
/// `int8_gemm::linear_as` decides).
fn takes_int8(ty: WeightType) -> bool {
    int8_gemm::supports(ty) && int8_gemm::available()
}

/// One product of a phase: out rows = x rows @ m^T (+ bias) (* the rows' weights).
struct Product<'a> {
    m: Matrix<'a>,
    x: usize,
    xq: Option<&'a QuantizedRows>,
    out: usize,
    geometry: Geometry,
    scale: Option<&'a [f32]>,
}

impl<'a> Product<'a> {
    /// Segment `s`'s product with m [n, k]: its input rows at `x.0` (quantized: `x.1`), its
    /// output rows in the [P, n] buffer at `out`.
    fn new(
        m: Matrix<'a>,
        s: &Segment,
        x: (usize, &'a Option<QuantizedRows>),
        out: usize,
        (n, k): (usize, usize),
        scale: Option<&'a [f32]>,
    ) -> Self {
        let lens = (s.rows * k, m.w.len(), s.rows * n);
        Product {
            m,
            x: x.0,
            xq: x.1.as_ref(),
            out: at(out, s.start * n),
            geometry: Geometry::checked("moe", m.ty, lens, (s.rows, n, k)),
            scale,
        }
    }

    /// Output columns `cols` of every row.
    /// SAFETY (caller): the buffers hold the geometry's shapes and no other thread writes
    /// these columns meanwhile.
    unsafe fn columns(&self, cols: std::ops::Range<usize>) {
        let (x, w, out) = (
            self.x as *const f32,
            self.m.w.as_ptr(),
            self.out as *mut f32,
        );
        match self.xq {
            Some(xq) if takes_int8(self.m.ty) => {
                int8_gemm::columns(self.m.ty, xq, w, out, &self.geometry, cols.clone())
            }
            _ => gemm::columns_on(
                gemm::widest(),
                self.m.ty,
                x,
                w,
                out,
                &self.geometry,
                cols.clone(),
            ),
        }
        let (m, n, _) = self.geometry.mnk;
        for r in 0..m {
            let row = std::slice::from_raw_parts_mut(out.add(r * n), n);
            if let Some(b) = self.m.bias {
                row[cols.clone()]
                    .iter_mut()
                    .zip(&b[cols.clone()])
                    .for_each(|(o, b)| *o += b);
            }
            if let Some(w) = self.scale {
                row[cols.clone()].iter_mut().for_each(|o| *o *= w[r]);
            }
        }
    }
}

/// Every product's output columns as tasks of `column_block` columns (0: `auto_block`), run
/// in one parallel region.
fn run_products(products: &[Product], plan: Plan) {
    let Some(first) = products.first() else {
        return;
    };
    let n = first.geometry.mnk.1; // one phase: every product has n outputs
    let block = match plan.column_block {
        0 => auto_block(n, products.len(), plan.threads),
        b => b.min(n),
    };
    let per = n.div_ceil(block);
    omp::run_tasks(products.len() * per, plan.threads, &|task| {
        let (p, c) = (&products[task / per], task % per);
        // SAFETY: tasks cover disjoint (product, columns) parts; every product's buffers were
        // sized by `Geometry::checked` in `Product::new`.
        unsafe { p.columns(c * block..((c + 1) * block).min(n)) }
    });
}

/// Columns per task: at most `MAX_BLOCK`, and fewer where the products would otherwise give a
/// thread fewer than two tasks (blocks of at least 64 columns). Measured on the 30B-A3B shape
/// (`benchmarks/cpu_moe_kernel.py`, 2 threads): blocks of 256 as fast as whole matrices at 1
/// token and up to 2x faster at 32 tokens, where whole matrices leave one thread finishing a
/// busy expert alone; blocks of 64 slower than 256 there.
pub fn auto_block(n: usize, products: usize, threads: usize) -> usize {
    const MAX_BLOCK: usize = 256;
    let want = 2 * threads.max(1);
    let parts = want.div_ceil(products.max(1)).min(n.div_ceil(64)).max(1);
    n.div_ceil(parts).min(MAX_BLOCK)
}

#[cfg(test)]
mod tests;
