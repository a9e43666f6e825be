//! eaglebatch's Rust core: everything that is not tensor math, plus the CPU path for the few
//! query rows of CPU decode steps (`small_gemm`, the float32 GEMM, `paged_attention`, and
//! `decoder_layer`, which runs whole layers on them; their headers say why).
//!
//! Data flow: `reader` (Parquet -> chat template -> tokens, background thread) -> `scheduler`
//! (continuous batching over the paged KV cache of `block_manager`; the Python worker runs each
//! `StepPlan` and `commit`s sampled tokens; `detokenizer` + stop conditions) -> `writer`
//! (Parquet part files, background thread). `python` (feature "python") is the thin PyO3 layer.

pub mod block_manager;
pub mod chat_template;
pub mod column_kind;
pub mod config;
pub mod decoder_layer;
pub mod detokenizer;
pub mod error;
pub mod logprobs;
pub mod omp;
pub mod openai_batch;
pub mod openai_keys;
pub mod paged_attention;
pub mod quant;
pub mod reader;
pub mod sampling_params;
pub mod scheduler;
pub mod sequence;
pub mod small_gemm;
pub mod stats;
pub mod template_guard;
pub mod template_memory;
pub mod writer;

#[cfg(feature = "python")]
mod python;

#[cfg(test)]
pub(crate) mod testutil;

pub use chat_template::{render_chat_template, ChatTemplate, Message};
pub use config::SchedulerConfig;
pub use error::{Error, Result};
pub use scheduler::{Scheduler, StepKind, StepPlan};
pub use stats::{Summary, SummaryValue};
