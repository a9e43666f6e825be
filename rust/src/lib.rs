//! eaglebatch's Rust core: two programs side by side.
//!
//! The scheduler with its I/O, everything that is not tensor math. Data flow: `reader`
//! (Parquet -> chat template -> tokens, background thread) -> `scheduler` (continuous batching
//! over the paged KV cache of `block_manager`; the Python worker runs each `StepPlan` and
//! `commit`s sampled tokens; `detokenizer` + stop conditions) -> `writer` (Parquet part files,
//! background thread). `python` (feature "python") is its thin PyO3 layer.
//!
//! `cpu`: the CPU path for the few query rows of CPU decode steps (`cpu::small_gemm`, the
//! float32 GEMM, `cpu::paged_attention`, and `cpu::decoder_layer`, which runs whole layers on
//! them; their headers say why), with its own Python bindings. Neither program uses the
//! other's modules: the bindings share only `exceptions`, and `python`'s module init
//! registers `cpu`'s.
//!
//! Module dependencies point one way, wings included (scripts/rust_module_cycles.py).

pub mod block_manager;
pub mod chat_template;
pub mod column_kind;
pub mod config;
pub mod cpu;
pub mod detokenizer;
pub mod error;
pub mod logprobs;
pub mod openai_batch;
pub mod openai_keys;
pub mod pooled;
pub mod reader;
pub mod run;
pub mod sampling_params;
pub mod scheduler;
pub mod score;
pub mod sequence;
pub mod state_checkpoints;
pub mod stats;
pub mod stop;
pub mod storage;
pub mod structured;
pub mod template_guard;
pub mod template_memory;
pub mod writer;

#[cfg(feature = "python")]
mod exceptions;
#[cfg(feature = "python")]
mod python;

#[cfg(test)]
pub(crate) mod testutil;

pub use chat_template::{render_chat_template, ChatTemplate, Message};
pub use config::RunConfig;
pub use error::{Error, Result};
pub use run::Run;
pub use scheduler::{Scheduler, StepKind, StepPlan};
pub use stats::{Summary, SummaryValue};
