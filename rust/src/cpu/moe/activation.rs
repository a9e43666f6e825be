//! The gated activations of an expert's MLP: `gate = act(gate, up)` element by element, each
//! output a function of its own two inputs only (a row's result does not depend on the others).

use crate::cpu::decoder_layer::silu_mul;
use crate::cpu::paged_attention::exp_nonpositive;

/// How an expert combines its gate and up projections (the value `down` multiplies).
/// A new kind is a variant here, its element function below and its name in `parse`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    /// silu(gate) * up (SwiGLU: Qwen, Mixtral).
    Silu,
    /// gelu_tanh(gate) * up, GELU's tanh approximation (GeGLU: Gemma).
    GeluTanh,
    /// gpt-oss's clamped SwiGLU: g = min(gate, limit), u = clamp(up, -limit, limit),
    /// g * sigmoid(alpha * g) * (u + 1).
    ClampedSwiglu { alpha: f32, limit: f32 },
}

impl Activation {
    /// The activation named `name` ("silu", "gelu_tanh", "clamped_swiglu"; alpha and limit are
    /// read by the last only), None for another name.
    pub fn parse(name: &str, alpha: f32, limit: f32) -> Option<Self> {
        match name {
            "silu" => Some(Self::Silu),
            "gelu_tanh" => Some(Self::GeluTanh),
            "clamped_swiglu" => Some(Self::ClampedSwiglu { alpha, limit }),
            _ => None,
        }
    }

    /// gate[i] = act(gate[i], up[i]) over one row (equal lengths).
    pub fn apply(self, gate: &mut [f32], up: &[f32]) {
        assert_eq!(gate.len(), up.len(), "gate and up rows differ in length");
        match self {
            // the decoder layer's lanes (the same operations per element as `silu`)
            Self::Silu if !gate.is_empty() => silu_mul(gate, up, gate.len()),
            Self::Silu => {}
            Self::GeluTanh => gate
                .iter_mut()
                .zip(up)
                .for_each(|(g, u)| *g = gelu_tanh(*g) * u),
            Self::ClampedSwiglu { alpha, limit } => {
                for (g, u) in gate.iter_mut().zip(up) {
                    *g = clamped_swiglu(*g, *u, alpha, limit);
                }
            }
        }
    }
}

/// 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))).
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let inner = SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x);
    0.5 * x * (1.0 + inner.tanh())
}

/// 1 / (1 + e^-x) through `exp_nonpositive` (e^-|x| never overflows), as `silu` forms it.
#[inline]
fn sigmoid(x: f32) -> f32 {
    let e = exp_nonpositive(-x.abs());
    if x >= 0.0 {
        1.0 / (1.0 + e)
    } else {
        e / (1.0 + e)
    }
}

/// gpt-oss's gate: the clamps pass NaN through, as torch's clamp does.
#[inline]
fn clamped_swiglu(gate: f32, up: f32, alpha: f32, limit: f32) -> f32 {
    let g = if gate > limit { limit } else { gate };
    let u = if up > limit {
        limit
    } else if up < -limit {
        -limit
    } else {
        up
    };
    g * sigmoid(alpha * g) * (u + 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::decoder_layer::silu;

    fn sigmoid64(x: f64) -> f64 {
        1.0 / (1.0 + (-x).exp())
    }

    #[test]
    fn each_kind_matches_its_float64_formula() {
        let xs = [
            -30.0f32, -7.5, -2.0, -0.3, 0.0, 0.25, 1.0, 3.0, 6.9, 7.2, 40.0,
        ];
        let up: Vec<f32> = xs.iter().rev().map(|v| v * 0.7).collect();
        let check = |act: Activation, want: &dyn Fn(f64, f64) -> f64| {
            let mut g = xs.to_vec();
            act.apply(&mut g, &up);
            for (i, got) in g.iter().enumerate() {
                let w = want(xs[i] as f64, up[i] as f64);
                let tol = 2e-6 * w.abs().max(1.0);
                assert!(
                    (*got as f64 - w).abs() <= tol,
                    "{act:?} {}: {got} vs {w}",
                    xs[i]
                );
            }
        };
        check(Activation::Silu, &|g, u| g * sigmoid64(g) * u);
        let c = (2.0 / std::f64::consts::PI).sqrt();
        check(Activation::GeluTanh, &|g, u| {
            0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh()) * u
        });
        let (alpha, limit) = (1.702f32, 7.0f32);
        check(Activation::ClampedSwiglu { alpha, limit }, &|g, u| {
            let g = g.min(limit as f64);
            let u = u.clamp(-limit as f64, limit as f64);
            g * sigmoid64(alpha as f64 * g) * (u + 1.0)
        });
    }

    #[test]
    fn silu_rows_equal_the_decoder_layers_silu() {
        let g: Vec<f32> = crate::testutil::values(37, 1)
            .iter()
            .map(|v| v * 20.0)
            .collect();
        let u = crate::testutil::values(37, 2);
        let mut got = g.clone();
        Activation::Silu.apply(&mut got, &u);
        for i in 0..37 {
            assert_eq!(got[i].to_bits(), (silu(g[i]) * u[i]).to_bits());
        }
    }

    #[test]
    fn names_parse_and_others_do_not() {
        assert_eq!(Activation::parse("silu", 0.0, 0.0), Some(Activation::Silu));
        assert_eq!(
            Activation::parse("clamped_swiglu", 1.5, 7.0),
            Some(Activation::ClampedSwiglu {
                alpha: 1.5,
                limit: 7.0
            })
        );
        assert_eq!(Activation::parse("gelu", 0.0, 0.0), None);
    }
}
