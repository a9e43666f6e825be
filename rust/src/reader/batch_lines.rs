//! The reader thread's OpenAI Batch input: JSONL files read `read_batch_rows` lines at a time,
//! each line parsed (openai_batch.rs) into a request whose problems make an error row.

use std::io::BufRead;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use arrow_array::{ArrayRef, StringArray};

use super::{unreadable, PendingRow, ReaderThread, RowResult, Stop};
use crate::chat_template::Message;
use crate::openai_batch::{Prompt, EMBEDDINGS_URL};
use crate::openai_keys::Endpoint;
use crate::storage::Source;

impl ReaderThread {
    /// Reads an OpenAI Batch JSONL file `read_batch_rows` requests at a time.
    pub(super) fn read_batch_file(&mut self, path: &Path) -> std::result::Result<(), Stop> {
        let fail = |e: &dyn std::fmt::Display| Stop::Failed(unreadable(path, None, e));
        let file = Source::open(path, &self.spec.storage).map_err(|e| fail(&e))?;
        let mut lines = Vec::with_capacity(self.opts.read_batch_rows);
        for (i, line) in std::io::BufReader::new(file.into_read())
            .split(b'\n')
            .enumerate()
        {
            if self.next_row + lines.len() as u64 >= self.spec.row_end {
                break;
            }
            let mut line = line.map_err(|e| fail(&e))?;
            let bom = line.len() - crate::openai_batch::without_bom(&line, i).len();
            line.drain(..bom);
            if crate::openai_batch::is_blank(&line) {
                continue;
            }
            lines.push((i as u64 + 1, String::from_utf8(line).ok()));
            if lines.len() >= self.opts.read_batch_rows {
                self.process_lines(&std::mem::take(&mut lines))?;
            }
        }
        self.process_lines(&lines)
    }

    /// Requests from (line number, text) lines: a line's problem is its row's error.
    /// (A line that is not UTF-8 has no text.)
    fn process_lines(&mut self, lines: &[(u64, Option<String>)]) -> std::result::Result<(), Stop> {
        let read_at = Instant::now();
        let mut rows = Vec::with_capacity(lines.len());
        for (line_no, text) in lines {
            let row_index = self.next_row as i64;
            self.next_row += 1;
            let job = &self.opts.sampling;
            let parsed = match text {
                Some(t) => crate::openai_batch::parse_line(t, *line_no, job, self.opts.n),
                None => crate::openai_batch::BatchLine {
                    custom_id: None,
                    endpoint: None,
                    request: Err(format!("line {line_no}: not valid UTF-8")),
                },
            };
            let id: ArrayRef = Arc::new(StringArray::from(vec![parsed.custom_id.clone()]));
            let id_error = match parsed.custom_id {
                Some(_) => self.check_id(id.as_ref(), 0),
                None => None,
            };
            if row_index < self.spec.row_start as i64 || self.is_skipped(row_index) {
                continue;
            }
            let (mut texts, mut embed_line) = (Ok(Vec::new()), None);
            let served = self.served(parsed.endpoint);
            let (input, sampling) = match (id_error.or(served), parsed.request) {
                (Some(e), _) => (
                    Err(format!("line {line_no}: {e}")),
                    self.opts.sampling.clone(),
                ),
                (None, Err(e)) => (Err(e), self.opts.sampling.clone()),
                (None, Ok((Prompt::Inputs(inputs, line), sp))) => {
                    (texts, embed_line) = (Ok(inputs), Some(line));
                    (Ok((String::new(), true)), sp)
                }
                (None, Ok((prompt, sp))) => (self.batch_input(prompt), sp),
            };
            rows.push(PendingRow {
                row_index,
                id,
                sampling,
                input,
                endpoint: parsed.endpoint,
                kept: Vec::new(),
                score_texts: texts,
                embed_line,
            });
        }
        self.send_rows(rows, read_at)
    }

    /// Why this job cannot answer a line of `endpoint` (None: it can): `task: embed` answers
    /// `/v1/embeddings` lines only, and only it answers them.
    fn served(&self, endpoint: Option<Endpoint>) -> Option<String> {
        let embed = self.opts.pool.is_some();
        match endpoint {
            Some(Endpoint::Embeddings) if !embed => {
                Some(format!("url {EMBEDDINGS_URL} needs task: embed"))
            }
            Some(e) if embed && e != Endpoint::Embeddings => Some(format!(
                "url {}: task embed answers {EMBEDDINGS_URL} lines only",
                e.url()
            )),
            _ => None,
        }
    }

    /// The text to tokenize for a batch line's prompt (and whether to add special tokens).
    fn batch_input(&mut self, prompt: crate::openai_batch::Prompt) -> RowResult<(String, bool)> {
        match prompt {
            crate::openai_batch::Prompt::Chat(msgs) => {
                let content = |m: &Message| {
                    m.iter()
                        .map(|(_, v)| v.as_deref().map_or(0, str::len))
                        .sum::<usize>()
                };
                let bytes = msgs.iter().map(content).sum();
                let chars = || {
                    msgs.iter()
                        .flatten()
                        .map(|(_, v)| v.as_deref().map_or(0, |c| c.chars().count()))
                        .sum()
                };
                self.opts
                    .text_limit
                    .check("messages' content has", bytes, chars)?;
                self.render(&msgs).map(|text| (text, false))
            }
            Prompt::Inputs(..) => unreachable!("embeddings lines have no prompt"),
            crate::openai_batch::Prompt::Text(text) => {
                if text.is_empty() {
                    return Err("body.prompt is empty".into());
                }
                self.opts
                    .text_limit
                    .check("prompt has", text.len(), || text.chars().count())?;
                Ok((text, true))
            }
        }
    }
}
