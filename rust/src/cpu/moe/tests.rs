use super::*;
use crate::cpu::int8_gemm::Activations;
use crate::testutil::{random_blocks, values};

/// A layer of `e` experts, every matrix of type `ty` (random contents), with biases or not.
struct Layer {
    dims: Dims,
    ty: WeightType,
    w: Vec<[Vec<u8>; 3]>,
    bias: Vec<[Vec<f32>; 3]>,
    biased: bool,
}

impl Layer {
    fn new(ty: WeightType, e: usize, dims: Dims, biased: bool) -> Self {
        let (h, i) = (dims.hidden, dims.inner);
        let mat = |n: usize, k: usize, seed: u64| match ty {
            WeightType::F32 => values(n * k, seed)
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            _ => random_blocks(ty, n, k, seed),
        };
        let w = (0..e as u64)
            .map(|x| {
                [
                    mat(i, h, 3 * x + 1),
                    mat(i, h, 3 * x + 2),
                    mat(h, i, 3 * x + 3),
                ]
            })
            .collect();
        let bias = (0..e as u64)
            .map(|x| [values(i, 90 + x), values(i, 190 + x), values(h, 290 + x)])
            .collect();
        Layer {
            dims,
            ty,
            w,
            bias,
            biased,
        }
    }

    fn experts(&self) -> Vec<Expert<'_>> {
        let m = |e: usize, j: usize| Matrix {
            ty: self.ty,
            w: &self.w[e][j],
            bias: self.biased.then(|| &self.bias[e][j][..]),
        };
        (0..self.w.len())
            .map(|e| Expert {
                gate: m(e, 0),
                up: m(e, 1),
                down: m(e, 2),
            })
            .collect()
    }

    fn run(
        &self,
        x: &[f32],
        ids: &[i64],
        wts: &[f32],
        k: usize,
        act: Activation,
        plan: Plan,
    ) -> Vec<f32> {
        let mut out = vec![f32::NAN; x.len()];
        let routing = Routing {
            ids,
            weights: wts,
            k,
        };
        forward(x, &mut out, self.dims, &self.experts(), &routing, act, plan);
        out
    }
}

/// The Python grouped path's operations, one token and one expert at a time, on the same GEMMs:
/// y = (down(act(gate x + bg, up x + bu)) + bd) * w, summed from zero in ascending expert order.
fn per_token(
    layer: &Layer,
    x: &[f32],
    ids: &[i64],
    wts: &[f32],
    k: usize,
    act: Activation,
    acts: Activations,
) -> Vec<f32> {
    let Dims {
        hidden: h,
        inner: i,
    } = layer.dims;
    let experts = layer.experts();
    let mut out = vec![0f32; x.len()];
    let lin = |m: &Matrix, x: &[f32], n: usize| {
        let mut y = vec![0f32; n];
        int8_gemm::linear_as(acts, m.ty, x, m.w, &mut y, (1, n, x.len()), 1);
        if let Some(b) = m.bias {
            y.iter_mut().zip(b).for_each(|(y, b)| *y += b);
        }
        y
    };
    for (t, row) in x.chunks_exact(h).enumerate() {
        let mut slots: Vec<usize> = (0..k).collect();
        slots.sort_by_key(|&j| ids[t * k + j]);
        for j in slots {
            let e = &experts[ids[t * k + j] as usize];
            let mut g = lin(&e.gate, row, i);
            act.apply(&mut g, &lin(&e.up, row, i));
            let y = lin(&e.down, &g, h);
            for (o, y) in out[t * h..][..h].iter_mut().zip(y) {
                *o += y * wts[t * k + j];
            }
        }
    }
    out
}

fn routing(tokens: usize, k: usize, e: usize, seed: u64) -> (Vec<i64>, Vec<f32>) {
    let r = values(tokens * k, seed);
    let mut ids = Vec::new();
    for t in 0..tokens {
        let first = ((r[t * k] + 0.5) * e as f32) as usize;
        ids.extend((0..k).map(|j| ((first + 3 * j) % e) as i64)); // distinct for k <= e / 3
    }
    (ids, r.iter().map(|v| v + 0.5).collect())
}

const PLAN: Plan = Plan {
    threads: 3,
    column_block: 0,
    acts: Activations::Float32,
};

#[test]
fn the_call_equals_the_per_expert_path_bit_for_bit() {
    if !gemm::available() {
        return;
    }
    let dims = Dims {
        hidden: 64,
        inner: 96,
    };
    let acts_cases = [
        (WeightType::F32, Activation::Silu, false),
        (WeightType::Q4_0, Activation::GeluTanh, true),
        (
            WeightType::Q8_0,
            Activation::ClampedSwiglu {
                alpha: 1.702,
                limit: 0.2,
            },
            true,
        ),
        (WeightType::Mxfp4, Activation::Silu, false),
    ];
    for (ty, act, biased) in acts_cases {
        let layer = Layer::new(ty, 8, dims, biased);
        let (tokens, k) = (5, 2);
        let x = values(tokens * dims.hidden, 7);
        let (ids, wts) = routing(tokens, k, 8, 8);
        for acts in [Activations::Float32, Activations::Int8] {
            let want = per_token(&layer, &x, &ids, &wts, k, act, acts);
            for column_block in [0, 2, 17, 1000] {
                let plan = Plan {
                    column_block,
                    acts,
                    ..PLAN
                };
                let got = layer.run(&x, &ids, &wts, k, act, plan);
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{ty:?} {act:?} {acts:?} block {column_block}");
            }
        }
    }
}

#[test]
fn a_row_is_the_same_alone_as_among_others_and_an_expert_may_have_many_rows() {
    if !gemm::available() {
        return;
    }
    let dims = Dims {
        hidden: 32,
        inner: 64,
    };
    let layer = Layer::new(WeightType::Q4_0, 4, dims, false);
    // 140 tokens, slot 0 always expert 1: more than MAX_ROWS rows for one expert
    let (tokens, k) = (MAX_ROWS + 12, 2);
    let x = values(tokens * dims.hidden, 1);
    let ids: Vec<i64> = (0..tokens).flat_map(|t| [1, [0, 2, 3][t % 3]]).collect();
    let wts = values(tokens * k, 2);
    for acts in [Activations::Float32, Activations::Int8] {
        let plan = Plan { acts, ..PLAN };
        let all = layer.run(&x, &ids, &wts, k, Activation::Silu, plan);
        for t in [0, 1, 77, tokens - 1] {
            let h = dims.hidden;
            let one = layer.run(
                &x[t * h..][..h],
                &ids[t * k..][..k],
                &wts[t * k..][..k],
                k,
                Activation::Silu,
                plan,
            );
            let same = one
                .iter()
                .zip(&all[t * h..])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{acts:?} token {t}");
        }
    }
}

#[test]
fn float_weights_match_a_float64_reference() {
    let dims = Dims {
        hidden: 48,
        inner: 40,
    };
    if !gemm::available() {
        return;
    }
    let layer = Layer::new(WeightType::F32, 3, dims, true);
    let (tokens, k) = (4, 1);
    let x = values(tokens * 48, 4);
    let ids = [2i64, 0, 2, 1];
    let wts = [0.5f32, 1.0, 0.25, 2.0];
    let got = layer.run(&x, &ids, &wts, k, Activation::Silu, PLAN);
    let f = |b: &[u8]| -> Vec<f64> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect()
    };
    for t in 0..tokens {
        let e = ids[t] as usize;
        let (g, u, d) = (f(&layer.w[e][0]), f(&layer.w[e][1]), f(&layer.w[e][2]));
        let b = &layer.bias[e];
        let row = &x[t * 48..][..48];
        let dot = |w: &[f64], j: usize, v: &[f64]| {
            (0..v.len()).map(|c| w[j * v.len() + c] * v[c]).sum::<f64>()
        };
        let xv: Vec<f64> = row.iter().map(|&v| v as f64).collect();
        let a: Vec<f64> = (0..40)
            .map(|j| {
                let gj = dot(&g, j, &xv) + b[0][j] as f64;
                let uj = dot(&u, j, &xv) + b[1][j] as f64;
                gj / (1.0 + (-gj).exp()) * uj
            })
            .collect();
        for c in 0..48 {
            let want = (dot(&d, c, &a) + b[2][c] as f64) * wts[t] as f64;
            assert!(
                (got[t * 48 + c] as f64 - want).abs() < 1e-5,
                "token {t} col {c}"
            );
        }
    }
}

#[test]
fn bad_calls_are_errors() {
    let dims = Dims {
        hidden: 32,
        inner: 32,
    };
    let layer = Layer::new(WeightType::Q4_0, 2, dims, false);
    let experts = layer.experts();
    let ok = Routing {
        ids: &[0, 1],
        weights: &[0.5, 0.5],
        k: 2,
    };
    assert!(check(32, 32, dims, &experts, &ok).is_ok());
    let bad_id = Routing { ids: &[0, 2], ..ok };
    assert!(check(32, 32, dims, &experts, &bad_id)
        .unwrap_err()
        .contains("expert id 2"));
    let negative = Routing {
        ids: &[-1, 0],
        ..ok
    };
    assert!(check(32, 32, dims, &experts, &negative).is_err());
    assert!(check(33, 33, dims, &experts, &ok).is_err()); // x of another size
    assert!(check(
        32,
        32,
        dims,
        &experts,
        &Routing {
            weights: &[1.0],
            ..ok
        }
    )
    .is_err());
    let wide = Dims {
        hidden: 64,
        inner: 32,
    }; // the matrices are [32, 32]
    assert!(check(64, 64, wide, &experts, &ok)
        .unwrap_err()
        .contains("expert 0 gate"));
}

#[test]
fn auto_blocks_give_every_thread_work() {
    assert_eq!(auto_block(768, 16, 2), 256); // many products: blocks of 256
    assert_eq!(auto_block(200, 16, 2), 200); // a whole matrix below that
    assert_eq!(auto_block(2048, 1, 8), 128); // one product: split for 16 tasks
    assert_eq!(auto_block(100, 1, 8), 50); // blocks of at least 64 columns (2 of 50)
}
