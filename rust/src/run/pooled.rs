//! Pooled tasks in the run (pooled.rs): a row is one sequence that generates nothing; each
//! commit adds the worker's contributions of the plan's chunks to their rows' sums, and a row
//! finishes at the commit of the step that computed its last prompt token, its value made
//! from the sum (`PoolHead::finish`).

use super::{sample_key, Run};
use crate::error::{Error, Result};
use crate::pooled::PoolHead;
use crate::score::RowScore;
use crate::sequence::{FinishReason, Request, Sequence};
use crate::writer::OutputRow;

/// The worker's contributions of one step: `width` values per plan row, rows in plan order.
#[derive(Debug, Clone)]
pub struct PooledSums {
    pub rows: usize,
    pub width: usize,
    pub values: Vec<f32>,
}

impl Run {
    /// Queues a pooled row as one sequence (an embeddings line: one per input, its samples,
    /// but those written before), or writes its error row when it can never run.
    pub(super) fn accept_pooled(&mut self, mut req: Request, head: &PoolHead) -> Result<()> {
        let parts = std::mem::take(&mut req.score_parts);
        if req.embed_line.is_none() {
            return self.queue_pooled(req, 0, head);
        }
        let n = req.sampling.n as u32;
        self.requests_expected += n as i64 - self.cfg.sampling.params.n as i64;
        self.stats.requests_total = self.requests_expected.max(0) as u64;
        let line = req.embed_line.unwrap_or_default();
        if req.error.is_none() && line.dimensions > head.width {
            req.error = Some(format!(
                "body.dimensions = {} is more than the model's hidden_size ({})",
                line.dimensions, head.width
            ));
        }
        for (j, part) in parts.into_iter().enumerate() {
            if self
                .skip_samples
                .contains(&sample_key(req.row_index, j as u32))
            {
                continue;
            }
            let mut r = req.clone();
            r.prompt_ids = part.prompt_ids;
            self.queue_pooled(r, j as u32, head)?;
        }
        Ok(())
    }

    /// Queues sample `sample` of a pooled row (its prompt is `req.prompt_ids`), or writes its
    /// error row.
    fn queue_pooled(&mut self, req: Request, sample: u32, head: &PoolHead) -> Result<()> {
        let p = req.prompt_ids.len();
        let error = req.error.clone().or_else(|| self.pooled_error(p));
        self.stats.requests_read += 1;
        if let Some(msg) = error {
            return self.write_error_row(req, sample, msg);
        }
        self.stats.prompt_tokens_read += p as u64;
        let mut seq = Sequence::new(req, sample);
        seq.score_from = Some(head.pooling.needed_from(p) + 1);
        seq.pooled = Some(vec![0.0; head.width]);
        self.sched.enqueue(seq);
        Ok(())
    }

    /// Why a prompt of `p` tokens can never run.
    fn pooled_error(&self, p: usize) -> Option<String> {
        let policy = &self.cfg.policy;
        let blocks = p.div_ceil(policy.block_size.max(1));
        if p > policy.max_model_len {
            Some(format!(
                "prompt has {p} tokens; it must be at most max_model_len ({}) (or set \
                 embed.truncate to start or end)",
                policy.max_model_len
            ))
        } else if blocks > policy.num_blocks {
            Some(format!(
                "prompt has {p} tokens and needs {blocks} KV blocks, but the cache has only \
                 num_blocks = {}; raise engine.kv_cache_tokens",
                policy.num_blocks
            ))
        } else if p == 0 {
            Some("the prompt tokenized to 0 tokens".to_string())
        } else {
            None
        }
    }

    /// Adds each plan row's contribution to its row's sum (rows that left `running` since the
    /// plan was built drop theirs). `at`: each plan row's index in `running`.
    pub(super) fn add_pooled(&mut self, at: &[Option<usize>], sums: &PooledSums) {
        for (r, i) in at.iter().enumerate() {
            let Some(i) = *i else { continue };
            let part = &sums.values[r * sums.width..(r + 1) * sums.width];
            if let Some(sum) = self.sched.running_mut()[i].pooled.as_mut() {
                sum.iter_mut().zip(part).for_each(|(s, x)| *s += x);
            }
        }
    }

    /// Contributions, when the job pools, for every plan row at the head's width.
    pub(super) fn check_pooled(&self, rows: usize, sums: Option<&PooledSums>) -> Result<()> {
        let want = self.pool_head.as_ref().map(|h| h.width);
        match (want, sums) {
            (None, None) => Ok(()),
            (Some(w), Some(s)) if s.rows == rows && s.width == w && s.values.len() == rows * w => {
                Ok(())
            }
            (w, s) => Err(Error::internal(format!(
                "commit(): pooled contributions {:?} for a plan of {rows} rows, but the job's \
                 width is {w:?}",
                s.map(|s| (s.rows, s.width, s.values.len()))
            ))),
        }
    }

    /// The output row of a finished pooled row.
    pub(super) fn pooled_row(&mut self, mut seq: Sequence) -> OutputRow {
        let head = self.pool_head.clone().expect("a pooled task");
        let sum = seq.pooled.take().unwrap_or_default();
        let (len, line) = (seq.prompt_len(), seq.embed_line);
        let mut row = self.output_row(seq);
        if row.error.is_some() {
            row.finish_reason = FinishReason::Error;
            row.text_ids = None;
            return row;
        }
        let value = match line {
            Some(line) => head.finish_line(&sum, len, line),
            None => head.finish(&sum, len),
        };
        row.score = Some(RowScore::Pooled(value));
        row
    }
}
