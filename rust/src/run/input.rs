//! The run's input: requests from the reader thread become waiting sequences (one per sample
//! not written before), or error rows when they can never run.

use std::time::Instant;

use crossbeam_channel::TryRecvError;

use super::{sample_key, Run};
use crate::error::{Error, Result};
use crate::openai_keys::Endpoint;
use crate::reader::ReaderMsg;
use crate::scheduler::token_count;
use crate::sequence::{FinishReason, Request, Sequence};
use crate::stop::reasoning_open;
use crate::structured::RowMatcher;
use crate::writer::OutputRow;

impl Run {
    /// Moves requests from the reader into `waiting` (error rows straight to the writer) until
    /// `waiting` holds `max_batch_size` requests. With `block`, waits while nothing is
    /// runnable.
    pub(super) fn pull_input(&mut self, block: bool) -> Result<()> {
        while !self.input_done && self.sched.waiting_len() < self.cfg.policy.max_batch_size {
            let idle = self.sched.is_idle();
            let msg = if block && idle {
                match self.input.recv() {
                    Ok(m) => m,
                    Err(_) => {
                        self.input_done = true;
                        break;
                    }
                }
            } else {
                match self.input.try_recv() {
                    Ok(m) => m,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.input_done = true;
                        break;
                    }
                }
            };
            match msg {
                ReaderMsg::Request(req) => self.accept(req)?,
                ReaderMsg::Failed(e) => {
                    // The rows before it still run; next_plan reports it once they are done.
                    self.input_failed = Some((e.to_string(), matches!(e, Error::UserInput(_))));
                    self.input_done = true;
                }
            }
        }
        Ok(())
    }

    /// The error of the reader's failure, if it failed.
    pub(super) fn input_failure(&self) -> Option<Error> {
        self.input_failed.as_ref().map(|(msg, user)| {
            if *user {
                Error::user(msg.clone())
            } else {
                Error::internal(format!("reading the input failed: {msg}"))
            }
        })
    }

    /// Queues the request's samples not written yet (one sequence each), or writes them as
    /// error rows when the request can never run.
    fn accept(&mut self, req: Request) -> Result<()> {
        if self.cfg.score_shape().is_some() {
            return self.accept_scored(req);
        }
        if let Some(head) = self.pool_head.clone() {
            return self.accept_pooled(req, &head);
        }
        let n = req.sampling.n as u32;
        self.requests_expected += n as i64 - self.cfg.sampling.params.n as i64;
        self.stats.requests_total = self.requests_expected.max(0) as u64;
        let key = |s: u32| sample_key(req.row_index, s);
        let samples: Vec<u32> = (0..n)
            .filter(|&s| !self.skip_samples.contains(&key(s)))
            .collect();
        let mut error = self.sched.admission_error(&req);
        self.stats.requests_read += samples.len() as u64;
        let mut matcher = None;
        if error.is_none() && !samples.is_empty() {
            match self.row_matcher(&req.sampling)? {
                Some(Err(msg)) => error = Some(msg),
                Some(Ok(m)) => matcher = Some(m),
                None => {}
            }
        }
        match error {
            Some(msg) => {
                for s in samples {
                    self.write_error_row(req.clone(), s, msg.clone())?;
                }
            }
            None => {
                self.stats.prompt_tokens_read += (req.prompt_ids.len() * samples.len()) as u64;
                for s in samples {
                    let mut seq = Sequence::new(req.clone(), s);
                    seq.prompt_logprobs_k = self.cfg.output.prompt_logprobs;
                    seq.matcher = matcher.as_ref().map(RowMatcher::fork);
                    seq.thinking = self
                        .criteria
                        .reasoning
                        .is_some_and(|tags| reasoning_open(&seq.prompt_ids, tags));
                    self.stats.structured_rows += seq.matcher.is_some() as u64;
                    self.queue(seq)?;
                }
            }
        }
        Ok(())
    }

    /// Queues an admitted sequence, or writes it finished (`stop`, no token) when its format
    /// allows only the empty text and it does not reason first: nothing is left to generate,
    /// whatever its min_new_tokens.
    fn queue(&mut self, mut seq: Sequence) -> Result<()> {
        let ends = seq.matcher.as_ref().is_some_and(RowMatcher::only_ends);
        if !ends || seq.thinking {
            self.sched.enqueue(seq);
            return Ok(());
        }
        seq.finish(FinishReason::Stop, Instant::now());
        let row = self.output_row(seq);
        self.writer.send(row)
    }

    pub(super) fn write_error_row(&mut self, req: Request, sample: u32, msg: String) -> Result<()> {
        self.stats.requests_done += 1;
        self.stats.requests_error += 1;
        self.writer.send(OutputRow {
            id: req.id,
            row_index: req.row_index,
            sample_index: sample as i32,
            num_samples: req.sampling.n as i32,
            output_text: String::new(),
            finish_reason: FinishReason::Error,
            // The real count when the prompt was tokenized (e.g. too long), else 0.
            prompt_tokens: token_count(req.prompt_ids.len()),
            output_tokens: 0,
            cached_tokens: 0,
            queue_s: None,
            ttft_s: None,
            latency_s: None,
            tpot_s: None,
            error: Some(msg),
            spec_steps: None,
            accepted_tokens: None,
            accept_length: None,
            stop_reason: None,
            kept: req.kept,
            output_token_ids: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
            text_ids: None,
            reasoning_ids: None,
            reasoning_text: None,
            structured: None,
            skip_special_tokens: true,
            endpoint: req.endpoint.map(Endpoint::url),
            score: None,
        })
    }
}
