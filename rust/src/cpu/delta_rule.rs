//! The gated delta rule's recurrent form on the CPU: B rows of 1..k+1 tokens (decode and
//! speculative verify steps of a hybrid model's Gated DeltaNet layers), from each row's state,
//! keeping the state after every token. The reference is model/delta_rule.py's
//! `stepwise_delta_rule` (its notation); torch runs it as ~15 small ops per position over
//! [B, Hv, Dk, Dv] tensors, while here each (token, head) makes two passes over one
//! Dk x Dv state (16 KiB at 64 x 64: L1-resident), the inner loops over Dv contiguous values.
//!
//! Per (token t, value head h), S the state before t, S' the one after:
//!   S' = exp(g) S;  u = beta (v - S'^T k);  S' += k u^T;  o = S'^T q.
//! The same operations as the reference; sums run in another order (float32 rounding).

/// Sizes of one call: Hv heads, Dk key and Dv value values per head.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub heads: usize,
    pub dk: usize,
    pub dv: usize,
}

/// The per-token inputs (packed rows: row b owns the next lengths[b] tokens): q, k
/// [T, Hv, Dk] (normalised; q scaled), v [T, Hv, Dv], g, beta [T, Hv].
pub struct Inputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub g: &'a [f32],
    pub beta: &'a [f32],
}

/// Runs the recurrence: `states` [B, Hv, Dk, Dv] the rows' states before their first token
/// (not modified), `o` [T, Hv, Dv] the outputs, `after` [T, Hv, Dk, Dv] the state of token t's
/// row right after token t. Slice lengths are the caller's to check (`check_sizes`).
pub fn steps(
    d: Dims,
    lengths: &[usize],
    x: &Inputs,
    states: &[f32],
    o: &mut [f32],
    after: &mut [f32],
) {
    let size = d.dk * d.dv; // one head's state
    let mut u = vec![0f32; d.dv];
    let mut t = 0;
    for (b, &n) in lengths.iter().enumerate() {
        for j in 0..n {
            let (before, rest) = after.split_at_mut(t * d.heads * size);
            for h in 0..d.heads {
                let src = match j {
                    0 => &states[(b * d.heads + h) * size..][..size],
                    _ => &before[((t - 1) * d.heads + h) * size..][..size],
                };
                let th = t * d.heads + h;
                let head = Head {
                    q: &x.q[th * d.dk..][..d.dk],
                    k: &x.k[th * d.dk..][..d.dk],
                    v: &x.v[th * d.dv..][..d.dv],
                    decay: x.g[th].exp(),
                    beta: x.beta[th],
                };
                let dst = &mut rest[h * size..][..size];
                head.step(src, dst, &mut o[th * d.dv..][..d.dv], &mut u);
            }
            t += 1;
        }
    }
}

/// One (token, head): its inputs and its decay exp(g).
struct Head<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    decay: f32,
    beta: f32,
}

impl Head<'_> {
    /// dst := the state after this token from `src` (Dk rows of Dv); o := its output; `u`
    /// scratch of Dv.
    fn step(&self, src: &[f32], dst: &mut [f32], o: &mut [f32], u: &mut [f32]) {
        let dv = u.len();
        u.fill(0.0); // first S'^T k
        for (i, &ki) in self.k.iter().enumerate() {
            let (s, d) = (&src[i * dv..][..dv], &mut dst[i * dv..][..dv]);
            for c in 0..dv {
                let x = s[c] * self.decay;
                d[c] = x;
                u[c] += x * ki;
            }
        }
        for (uc, &vc) in u.iter_mut().zip(self.v) {
            *uc = self.beta * (vc - *uc);
        }
        o.fill(0.0);
        for (i, (&ki, &qi)) in self.k.iter().zip(self.q).enumerate() {
            let d = &mut dst[i * dv..][..dv];
            for c in 0..dv {
                let x = d[c] + ki * u[c];
                d[c] = x;
                o[c] += x * qi;
            }
        }
    }
}

/// Why buffers of these lengths cannot hold a call over `lengths` (None: they can).
pub fn check_sizes(
    d: Dims,
    lengths: &[usize],
    x: &Inputs,
    states: usize,
    o: usize,
    after: usize,
) -> Option<String> {
    let t: usize = lengths.iter().sum();
    let b = lengths.len();
    let (hk, hv, hs) = (d.heads * d.dk, d.heads * d.dv, d.heads * d.dk * d.dv);
    let want = [
        ("q", x.q.len(), t * hk),
        ("k", x.k.len(), t * hk),
        ("v", x.v.len(), t * hv),
        ("g", x.g.len(), t * d.heads),
        ("beta", x.beta.len(), t * d.heads),
        ("states", states, b * hs),
        ("o", o, t * hv),
        ("after", after, t * hs),
    ];
    if lengths.contains(&0) || d.heads == 0 || d.dk == 0 || d.dv == 0 {
        return Some(format!(
            "delta_rule_steps: empty rows or dims ({d:?}, lengths {lengths:?})"
        ));
    }
    want.iter()
        .find(|(_, got, need)| got != need)
        .map(|(name, got, need)| {
            format!("delta_rule_steps: {name} holds {got} values, needs {need}")
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The recurrence written out per element in f64, from the module doc's equations.
    fn reference(d: Dims, lengths: &[usize], x: &Inputs, states: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let t_all: usize = lengths.iter().sum();
        let (mut o, mut after) = (vec![0.0; t_all * d.heads * d.dv], Vec::new());
        let mut t = 0;
        for (b, &n) in lengths.iter().enumerate() {
            let size = d.heads * d.dk * d.dv;
            let mut s: Vec<f64> = states[b * size..][..size]
                .iter()
                .map(|&v| v as f64)
                .collect();
            for _ in 0..n {
                for h in 0..d.heads {
                    let th = t * d.heads + h;
                    let st = &mut s[h * d.dk * d.dv..][..d.dk * d.dv];
                    let decay = (x.g[th] as f64).exp();
                    st.iter_mut().for_each(|v| *v *= decay);
                    for c in 0..d.dv {
                        let pred: f64 = (0..d.dk)
                            .map(|i| st[i * d.dv + c] * x.k[th * d.dk + i] as f64)
                            .sum();
                        let u = x.beta[th] as f64 * (x.v[th * d.dv + c] as f64 - pred);
                        for i in 0..d.dk {
                            st[i * d.dv + c] += x.k[th * d.dk + i] as f64 * u;
                        }
                        o[th * d.dv + c] = (0..d.dk)
                            .map(|i| st[i * d.dv + c] * x.q[th * d.dk + i] as f64)
                            .sum();
                    }
                }
                after.extend_from_slice(&s);
                t += 1;
            }
        }
        (o, after)
    }

    fn noise(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
            })
            .collect()
    }

    #[test]
    fn steps_equal_the_recurrence_for_rows_of_several_lengths() {
        let d = Dims {
            heads: 3,
            dk: 5,
            dv: 7,
        };
        let lengths = [1, 4, 2];
        let t: usize = lengths.iter().sum();
        let (q, k, v) = (
            noise(t * 15, 1, 1.0),
            noise(t * 15, 2, 1.0),
            noise(t * 21, 3, 2.0),
        );
        let g: Vec<f32> = noise(t * 3, 4, 1.0).iter().map(|x| -x.abs()).collect();
        let beta: Vec<f32> = noise(t * 3, 5, 1.0).iter().map(|x| x.abs()).collect();
        let states = noise(3 * 105, 6, 1.0);
        let x = Inputs {
            q: &q,
            k: &k,
            v: &v,
            g: &g,
            beta: &beta,
        };
        assert_eq!(
            check_sizes(d, &lengths, &x, states.len(), t * 21, t * 105),
            None
        );
        let (mut o, mut after) = (vec![0.0; t * 21], vec![0.0; t * 105]);
        steps(d, &lengths, &x, &states, &mut o, &mut after);
        let (want_o, want_after) = reference(d, &lengths, &x, &states);
        for (got, want) in o.iter().zip(&want_o).chain(after.iter().zip(&want_after)) {
            assert!((*got as f64 - want).abs() < 1e-5, "{got} vs {want}");
        }
        assert!(check_sizes(d, &lengths, &x, states.len(), t * 21, t * 104).is_some());
    }
}
