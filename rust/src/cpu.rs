//! The CPU wing: float32 kernels for the few query rows of CPU decode and verify steps, and
//! their Python bindings. A program of its own beside the scheduler: this wing uses none of the
//! scheduler's modules and they use none of it (the Python worker calls both); the bindings
//! share only `exceptions` with the scheduler's, and `python`'s module init registers them.
//!
//! `small_gemm` (the GEMM over the weight formats of `quant`) and `paged_attention` are the
//! kernels, `decoder_layer` runs whole layers on them, `moe` a mixture-of-experts layer's
//! routed MLP, `omp` shares torch's OpenMP threads; their headers say why each is native. `bindings` (feature "python") exposes them.

pub mod bf16_rows;
pub mod decoder_layer;
pub mod delta_rule;
pub mod int8_gemm;
pub mod moe;
pub mod omp;
pub mod paged_attention;
pub mod quant;
pub mod small_gemm;

#[cfg(feature = "python")]
pub(crate) mod bindings;
