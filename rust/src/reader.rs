//! Input side: validate the Parquet files up front, then stream requests from a background
//! thread.
//!
//! The reader thread reads `read_batch_rows` rows at a time (only the needed columns), renders
//! the chat template where needed, tokenizes the batch and sends one `Request` per row into a
//! bounded channel of capacity `queue_rows`, so at most about `queue_rows + read_batch_rows`
//! rows are in memory on this side regardless of input size.
//!
//! Parts: `validate` (the up-front checks, giving the `InputSpec`), this file (the reader
//! thread over Parquet row groups, rendering and tokenization), `batch_lines` (its OpenAI Batch
//! JSONL input) and `columns` (a row's sampling values out of its Arrow columns).
//!
//! Invariants:
//! - requests are sent in input order with `row_index` = 0, 1, 2, ... across all files, and at
//!   most `limit` of them, except the rows listed in `skip_rows` (done by an earlier run of the
//!   same job), which are read but neither tokenized nor sent; with a `row_range` only the rows
//!   in it are sent (whole row groups before it are skipped, or read for their ids alone);
//! - a row that cannot be generated is still sent, with `error` set (never silently dropped);
//! - with an id column, a null id and an id equal to an earlier row's (skipped rows included,
//!   and rows before the range, so the verdict depends neither on where a run was resumed nor
//!   on how the input was sharded) make error rows. Ids are
//!   compared by 64-bit hash: memory is one `u64` set entry per row read.
//! - a failure of the input itself (I/O, corrupt page) is sent as `ReaderMsg::Failed` and ends
//!   the stream.

use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use arrow_array::cast::AsArray;
use arrow_array::{Array, ArrayRef, Int64Array, RecordBatch, StructArray};
use arrow_schema::DataType;
use crossbeam_channel::{Receiver, Sender};
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder,
};
use parquet::arrow::ProjectionMask;
use tokenizers::Tokenizer;

use crate::chat_template::{ChatTemplate, Message, RenderError};
use crate::column_kind::{conform, str_value};
use crate::error::{Error, Result};
use crate::sampling_params::SamplingParams;
use crate::score::{ScorePart, ScoreShape, Splitter};
use crate::sequence::Request;
use crate::storage::Source;

mod batch_lines;
pub mod columns;
mod validate;

use columns::RowSampling;
pub use validate::{check_job_inputs, validate_inputs, InputFile, InputSpec};

/// What the reader thread sends.
#[derive(Debug)]
pub enum ReaderMsg {
    Request(Request),
    /// The input could not be read; no more messages follow.
    Failed(Error),
}

/// Normalizers can shrink a text before it is split into tokens (NFC composition, stripping);
/// the character limit allows this factor for it.
const SHRINK_FACTOR: usize = 4;

/// How long a row's text may be before it is tokenized or rendered. A text of C characters
/// makes at least ceil(C / L) tokens, L being the longest vocabulary entry in characters (a
/// byte-level BPE entry has one character per byte, a SentencePiece entry about one per text
/// character), so a text over `max_chars` = SHRINK_FACTOR * L * max_model_len characters can
/// certainly not fit max_model_len: it becomes an error row without costing the tokenizer.
#[derive(Debug, Clone, Copy)]
pub struct TextLimit {
    pub max_chars: usize,
    /// L, at least 1.
    pub longest_token: usize,
    pub max_model_len: usize,
}

impl TextLimit {
    pub fn new(tokenizer: &Tokenizer, max_model_len: usize) -> Self {
        let longest = tokenizer
            .get_vocab(true)
            .keys()
            .map(|t| t.chars().count())
            .max()
            .unwrap_or(1)
            .max(1);
        TextLimit {
            max_chars: SHRINK_FACTOR
                .saturating_mul(longest)
                .saturating_mul(max_model_len),
            longest_token: longest,
            max_model_len,
        }
    }

    /// Why the limit is what it is, for error messages.
    fn reason(&self) -> String {
        format!(
            "more than {} characters cannot fit max_model_len = {} tokens (no token of this \
             tokenizer is longer than {} characters; the limit is {SHRINK_FACTOR} x {} x {})",
            self.max_chars,
            self.max_model_len,
            self.longest_token,
            self.longest_token,
            self.max_model_len
        )
    }

    /// Ok when a text of `bytes` bytes (`chars()` characters, counted only when needed, as
    /// characters <= bytes) may fit; else the row's error, `what` naming the text.
    fn check(&self, what: &str, bytes: usize, chars: impl FnOnce() -> usize) -> RowResult<()> {
        if bytes <= self.max_chars {
            return Ok(());
        }
        let n = chars();
        if n <= self.max_chars {
            return Ok(());
        }
        Err(format!(
            "{what} {n} characters: {}; it was not tokenized",
            self.reason()
        ))
    }
}

/// A row's value, or why the row cannot be generated (its error message).
type RowResult<T> = std::result::Result<T, String>;

/// Everything the reader thread needs besides the spec.
pub struct ReaderOptions {
    pub tokenizer: Arc<Tokenizer>,
    /// Compiled chat template (required for messages and for `apply_chat_template`).
    pub template: Option<ChatTemplate>,
    pub apply_chat_template: bool,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub read_batch_rows: usize,
    pub queue_rows: usize,
    /// Row indices not to send, sorted ascending without duplicates.
    pub skip_rows: Vec<i64>,
    /// Bounds a row's prompt, message contents and rendered chat before they are tokenized.
    pub text_limit: TextLimit,
    /// The job's sampling parameters (a row's sampling columns override them).
    pub sampling: Arc<SamplingParams>,
    /// Samples per row (an OpenAI Batch line's `n` must equal it).
    pub n: usize,
    /// Raw prompts are encoded with the tokenizer's special tokens.
    pub add_special_tokens: bool,
    /// A scoring task's settings (None: the rows generate).
    pub score: Option<ScoreOptions>,
    /// A pooled task's prompt prefix and truncation (pooled.rs; None: another task).
    pub pool: Option<crate::pooled::PoolInput>,
}

/// How a scoring task splits its rows into parts (score.rs).
#[derive(Debug, Clone, Copy)]
pub struct ScoreOptions {
    pub shape: ScoreShape,
    /// The token standing for an empty context (BOS, else EOS).
    pub prefix_id: u32,
    /// The longest part (`max_model_len`).
    pub max_len: usize,
}

/// Starts the reader thread; it stops early (quietly) when the receiver is dropped. A panic
/// in it (a decoder bug on corrupt data, say) is reported as `Failed` like any error, so the
/// input never silently ends early.
pub fn spawn_reader(
    spec: InputSpec,
    opts: ReaderOptions,
) -> Result<(Receiver<ReaderMsg>, JoinHandle<()>)> {
    let (tx, rx) = crossbeam_channel::bounded(opts.queue_rows.max(1));
    let handle = std::thread::Builder::new()
        .name("eaglebatch-reader".into())
        .spawn(move || {
            let mut worker = ReaderThread {
                spec,
                opts,
                tx,
                next_row: 0,
                next_skip: 0,
                seen_ids: HashSet::new(),
                position: None,
            };
            let err = match std::panic::catch_unwind(AssertUnwindSafe(|| worker.run())) {
                Ok(Ok(())) => return,
                Ok(Err(e)) => e,
                Err(payload) => worker.panic_error(payload.as_ref()),
            };
            // A send failure means the scheduler is gone: nobody to tell.
            let _ = worker.tx.send(ReaderMsg::Failed(err));
        })
        .map_err(|e| Error::internal(format!("cannot start reader thread: {e}")))?;
    Ok((rx, handle))
}

/// A failure to read an input file during the run (its footer passed validation): a user
/// error naming the file and, when known, the row group.
fn unreadable(path: &Path, row_group: Option<usize>, e: &dyn std::fmt::Display) -> Error {
    let at = row_group
        .map(|g| format!(", row group {g}"))
        .unwrap_or_default();
    Error::user(format!(
        "{}{at}: the input file is corrupt or unreadable: {e}",
        path.display()
    ))
}

/// Why a batch stopped being processed early.
enum Stop {
    /// The receiver hung up (scheduler dropped).
    Disconnected,
    Failed(Error),
}

impl From<Error> for Stop {
    fn from(e: Error) -> Self {
        Stop::Failed(e)
    }
}

/// What the reader thread is reading, for the message of a panic.
struct Position {
    path: PathBuf,
    row_group: usize,
    /// True while the Parquet decoder runs (a panic then means the data is bad).
    decoding: bool,
}

struct ReaderThread {
    spec: InputSpec,
    opts: ReaderOptions,
    tx: Sender<ReaderMsg>,
    next_row: u64,
    /// Position in `opts.skip_rows` of the first entry >= `next_row`.
    next_skip: usize,
    /// Hashes of the ids read so far (only with an id column).
    seen_ids: HashSet<u64>,
    position: Option<Position>,
}

/// A row between reading and tokenization: its id and either (text, add_special_tokens) or
/// an error message.
struct PendingRow {
    row_index: i64,
    id: ArrayRef,
    sampling: Arc<SamplingParams>,
    input: RowResult<(String, bool)>,
    /// An OpenAI Batch line's endpoint.
    endpoint: Option<crate::openai_keys::Endpoint>,
    /// `Request::kept`.
    kept: Vec<ArrayRef>,
    /// `task: score`: the row's continuation (one) or choices (any number); an embeddings
    /// line's inputs.
    score_texts: RowResult<Vec<String>>,
    /// An OpenAI Batch `/v1/embeddings` line's options.
    embed_line: Option<crate::pooled::EmbedLine>,
}

impl ReaderThread {
    fn run(&mut self) -> Result<()> {
        let files = self.spec.files.clone();
        for file in &files {
            if self.next_row >= self.spec.row_end {
                break;
            }
            if self.before_range(file.num_rows) && self.spec.id_column.is_none() {
                self.next_row += file.num_rows; // no id to see: not even opened
                continue;
            }
            let read = match self.spec.openai_batch {
                true => self.read_batch_file(&file.path),
                false => self.read_file(&file.path),
            };
            match read {
                Ok(()) => {}
                Err(Stop::Disconnected) => return Ok(()),
                Err(Stop::Failed(e)) => return Err(e),
            }
        }
        Ok(())
    }

    /// The error for a panic caught in `run`.
    fn panic_error(&self, payload: &(dyn std::any::Any + Send)) -> Error {
        let msg = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_string());
        match &self.position {
            Some(p) if p.decoding => unreadable(
                &p.path,
                Some(p.row_group),
                &format!("the Parquet decoder panicked: {msg}"),
            ),
            Some(p) => Error::internal(format!(
                "the input reader panicked on {}, row group {}: {msg}",
                p.path.display(),
                p.row_group
            )),
            None => Error::internal(format!("the input reader panicked: {msg}")),
        }
    }

    /// Whether the next `n` rows all lie before this run's range (read for their ids alone).
    fn before_range(&self, n: u64) -> bool {
        self.next_row + n <= self.spec.row_start
    }

    /// Reads one file row group by row group (so that a failure names its row group). Row
    /// groups before the range are skipped, or read for the id column alone when there is one.
    fn read_file(&mut self, path: &Path) -> std::result::Result<(), Stop> {
        let fail = |e: &dyn std::fmt::Display| Stop::Failed(unreadable(path, None, e));
        let file = Source::open(path, &self.spec.storage).map_err(|e| fail(&e))?;
        let meta = ArrowReaderMetadata::load(&file, ArrowReaderOptions::default())
            .map_err(|e| fail(&e))?;
        let mut roots = Vec::new();
        let text_and_id = [
            &self.spec.prompt_column,
            &self.spec.messages_column,
            &self.spec.id_column,
            &self.spec.score_column,
        ];
        let sampling = self.spec.sampling_columns.values();
        let kept = self.spec.kept.iter().map(|(c, _)| c);
        for col in text_and_id
            .into_iter()
            .flatten()
            .chain(sampling)
            .chain(kept)
        {
            let idx = meta.schema().index_of(col).map_err(|e| fail(&e))?;
            if !roots.contains(&idx) {
                roots.push(idx);
            }
        }
        let mask = ProjectionMask::roots(meta.parquet_schema(), roots);
        let id_only = match &self.spec.id_column {
            Some(col) => {
                let idx = meta.schema().index_of(col).map_err(|e| fail(&e))?;
                Some(ProjectionMask::roots(meta.parquet_schema(), [idx]))
            }
            None => None,
        };
        for g in 0..meta.metadata().num_row_groups() {
            if self.next_row >= self.spec.row_end {
                break;
            }
            let n = meta.metadata().row_group(g).num_rows().max(0) as u64;
            match (&id_only, self.before_range(n)) {
                (None, true) => self.next_row += n,
                (Some(ids), true) => self.read_row_group(path, &file, &meta, ids, g)?,
                (_, false) => self.read_row_group(path, &file, &meta, &mask, g)?,
            }
        }
        Ok(())
    }

    fn read_row_group(
        &mut self,
        path: &Path,
        file: &Source,
        meta: &ArrowReaderMetadata,
        mask: &ProjectionMask,
        g: usize,
    ) -> std::result::Result<(), Stop> {
        let fail = |e: &dyn std::fmt::Display| Stop::Failed(unreadable(path, Some(g), e));
        let input = file.try_clone().map_err(|e| fail(&e))?;
        let remaining = (self.spec.row_end - self.next_row) as usize;
        let mut reader = ParquetRecordBatchReaderBuilder::new_with_metadata(input, meta.clone())
            .with_row_groups(vec![g])
            .with_projection(mask.clone())
            .with_batch_size(self.opts.read_batch_rows)
            .with_limit(remaining)
            .build()
            .map_err(|e| fail(&e))?;
        self.position = Some(Position {
            path: path.to_path_buf(),
            row_group: g,
            decoding: false,
        });
        loop {
            self.set_decoding(true);
            let next = reader.next();
            self.set_decoding(false);
            let Some(batch) = next else { break };
            let batch = batch.map_err(|e| fail(&e))?;
            let remaining = (self.spec.row_end - self.next_row) as usize;
            let batch = if batch.num_rows() > remaining {
                batch.slice(0, remaining)
            } else {
                batch
            };
            self.process_batch(&batch)?;
            if self.next_row >= self.spec.row_end {
                break;
            }
        }
        Ok(())
    }

    fn set_decoding(&mut self, on: bool) {
        if let Some(p) = &mut self.position {
            p.decoding = on;
        }
    }

    fn process_batch(&mut self, batch: &RecordBatch) -> std::result::Result<(), Stop> {
        let read_at = Instant::now();
        let column = |name: &Option<String>| name.as_ref().and_then(|n| batch.column_by_name(n));
        let prompts = column(&self.spec.prompt_column);
        let messages = column(&self.spec.messages_column);
        let score = column(&self.spec.score_column);
        // Every file's ids as the output's one id type (decoded, widened: column_kind.rs).
        let ids = column(&self.spec.id_column)
            .map(|a| conform(a, &self.spec.id_type))
            .transpose()
            .map_err(|e| Stop::Failed(Error::internal(format!("id column: {e}"))))?;
        let ids = ids.as_ref();
        let kept = self.kept_columns(batch)?;
        let sampling = RowSampling::new(&self.spec.sampling_columns, batch);
        let mut rows = Vec::with_capacity(batch.num_rows());
        for i in 0..batch.num_rows() {
            let row_index = self.next_row as i64;
            self.next_row += 1;
            let id_error = ids.and_then(|a| self.check_id(a.as_ref(), i));
            if row_index < self.spec.row_start as i64 || self.is_skipped(row_index) {
                continue;
            }
            let id: ArrayRef = match ids {
                Some(a) => a.slice(i, 1),
                None => Arc::new(Int64Array::from(vec![row_index])),
            };
            let params = sampling.params(&self.opts.sampling, i);
            let input = match (id_error, &params) {
                (Some(e), _) => Err(e),
                (None, Err(e)) => Err(e.clone()),
                (None, Ok(_)) => self.row_input(prompts, messages, i),
            };
            rows.push(PendingRow {
                row_index,
                id,
                sampling: params.unwrap_or_else(|_| self.opts.sampling.clone()),
                input,
                endpoint: None,
                kept: kept_values(&kept, i)?,
                score_texts: score.map_or(Ok(Vec::new()), |c| self.score_texts(c, i)),
                embed_line: None,
            });
        }
        self.send_rows(rows, read_at)
    }

    /// The batch's kept columns, each as its output type (decoded, widened: column_kind.rs).
    fn kept_columns(&self, batch: &RecordBatch) -> std::result::Result<Vec<ArrayRef>, Stop> {
        let conformed = |(name, dt): &(String, DataType)| {
            let a = batch
                .column_by_name(name)
                .ok_or_else(|| format!("column '{name}' not read"))?;
            conform(a, dt).map_err(|e| format!("column '{name}': {e}"))
        };
        (self.spec.kept.iter().map(conformed))
            .collect::<std::result::Result<_, String>>()
            .map_err(|e| Stop::Failed(Error::internal(format!("output.keep_columns: {e}"))))
    }

    /// Row `i` of the score column: a continuation, or the choices (none null or empty).
    fn score_texts(&self, col: &ArrayRef, i: usize) -> RowResult<Vec<String>> {
        let name = self.spec.score_column.as_deref().unwrap_or_default();
        if col.is_null(i) {
            return Err(format!("column '{name}' is null"));
        }
        let texts = match col.data_type() {
            DataType::List(_) | DataType::LargeList(_) => {
                let items = match col.data_type() {
                    DataType::List(_) => col.as_list::<i32>().value(i),
                    _ => col.as_list::<i64>().value(i),
                };
                let texts: Option<Vec<String>> = (0..items.len())
                    .map(|j| str_value(items.as_ref(), j).map(str::to_string))
                    .collect();
                texts.ok_or_else(|| format!("choices column '{name}' holds a null choice"))?
            }
            _ => vec![str_value(col.as_ref(), i).unwrap_or_default().to_string()],
        };
        if texts.is_empty() || texts.iter().any(String::is_empty) {
            return Err(format!("column '{name}' holds no choice or an empty text"));
        }
        for t in &texts {
            self.opts
                .text_limit
                .check("a continuation has", t.len(), || t.chars().count())?;
        }
        Ok(texts)
    }

    /// A scoring row's parts (score.rs), or its error.
    fn score_parts(&self, row: &PendingRow, opts: ScoreOptions) -> RowResult<Vec<ScorePart>> {
        let (context, add_special) = row.input.as_ref().map_err(Clone::clone)?;
        let splitter = Splitter {
            tokenizer: &self.opts.tokenizer,
            add_special: *add_special,
            bos_text: self.opts.bos_token.as_deref(),
            prefix_id: opts.prefix_id,
            max_len: opts.max_len,
        };
        if opts.shape == ScoreShape::Rolling {
            return splitter.rolling(context);
        }
        let texts = row.score_texts.as_ref().map_err(Clone::clone)?;
        texts.iter().map(|t| splitter.pair(context, t)).collect()
    }

    /// Tokenizes the rows and sends them as requests, in order.
    fn send_rows(
        &mut self,
        rows: Vec<PendingRow>,
        read_at: Instant,
    ) -> std::result::Result<(), Stop> {
        let (token_ids, parts) = match self.opts.score {
            None => (self.pool_cut(self.tokenize(&rows)), self.line_parts(&rows)),
            Some(o) => (
                vec![Ok(Vec::new()); rows.len()],
                rows.iter().map(|r| self.score_parts(r, o)).collect(),
            ),
        };
        for ((row, ids), parts) in rows.into_iter().zip(token_ids).zip(parts) {
            // a row with parts (scored, or an embeddings line's inputs) has no prompt of its own
            let (prompt_ids, error) = match (ids, &parts) {
                (_, Err(msg)) => (Vec::new(), Some(msg.clone())),
                (_, Ok(p)) if !p.is_empty() => (Vec::new(), None),
                (Err(msg), _) => (Vec::new(), Some(msg)),
                (Ok(ids), Ok(_)) => (ids, None),
            };
            let req = Request {
                row_index: row.row_index,
                id: row.id,
                prompt_ids,
                sampling: row.sampling,
                read_at,
                error,
                endpoint: row.endpoint,
                kept: row.kept,
                score_parts: parts.unwrap_or_default(),
                embed_line: row.embed_line,
            };
            self.tx
                .send(ReaderMsg::Request(req))
                .map_err(|_| Stop::Disconnected)?;
        }
        Ok(())
    }

    /// An embeddings line's inputs as parts (one sequence each, tokenized with special tokens
    /// and cut as `embed.truncate` says); no parts for other rows.
    fn line_parts(&self, rows: &[PendingRow]) -> Vec<RowResult<Vec<ScorePart>>> {
        let one = |row: &PendingRow| -> RowResult<Vec<ScorePart>> {
            let (Some(_), Some(p)) = (row.embed_line, &self.opts.pool) else {
                return Ok(Vec::new());
            };
            let texts = row.score_texts.as_ref().map_err(Clone::clone)?;
            let encoded = (self.opts.tokenizer.encode_batch_fast(texts.clone(), true))
                .map_err(|e| format!("tokenizer error: {e}"))?;
            let part = |e: &tokenizers::Encoding| ScorePart {
                prompt_ids: p.truncate.apply(e.get_ids().to_vec(), p.max_len),
                from: 0,
            };
            Ok(encoded.iter().map(part).collect())
        };
        rows.iter().map(one).collect()
    }

    /// A pooled task's prompts cut to its length as `embed.truncate` says (others as they are).
    fn pool_cut(&self, ids: Vec<RowResult<Vec<u32>>>) -> Vec<RowResult<Vec<u32>>> {
        let Some(p) = &self.opts.pool else { return ids };
        ids.into_iter()
            .map(|r| r.map(|ids| p.truncate.apply(ids, p.max_len)))
            .collect()
    }

    /// Whether `row_index` was done by an earlier run. Called with increasing row indices.
    fn is_skipped(&mut self, row_index: i64) -> bool {
        let skip = &self.opts.skip_rows;
        while self.next_skip < skip.len() && skip[self.next_skip] < row_index {
            self.next_skip += 1;
        }
        skip.get(self.next_skip) == Some(&row_index)
    }

    /// Records row `i`'s id; the error if it is null or an earlier row had the same id.
    fn check_id(&mut self, ids: &dyn Array, i: usize) -> Option<String> {
        let name = self.spec.id_column.as_deref().unwrap_or_default();
        let Some(h) = id_hash(ids, i) else {
            return Some(format!("id column '{name}' is null"));
        };
        if self.seen_ids.insert(h) {
            None
        } else {
            Some(format!(
                "duplicate id: an earlier row has the same value in id column '{name}' \
                 (only the first row with an id is generated)"
            ))
        }
    }

    /// The text to tokenize for row `i` (and whether to add special tokens), or why there is
    /// none. Messages win over the prompt when both columns are configured and non-null. A
    /// text over `text_limit` is refused before it is copied, rendered or tokenized.
    fn row_input(
        &mut self,
        prompts: Option<&ArrayRef>,
        messages: Option<&ArrayRef>,
        i: usize,
    ) -> RowResult<(String, bool)> {
        let col_name = |c: &Option<String>| c.clone().unwrap_or_default();
        if let Some(m) = messages {
            if m.is_valid(i) {
                let msgs = parse_messages(m.as_ref(), i, &self.opts.text_limit)?;
                return self.render(&msgs).map(|text| (text, false));
            }
            if prompts.is_none() {
                return Err(format!(
                    "messages column '{}' is null",
                    col_name(&self.spec.messages_column)
                ));
            }
        }
        let p = prompts.ok_or_else(|| "no prompt".to_string())?;
        let name = col_name(&self.spec.prompt_column);
        let Some(text) = str_value(p.as_ref(), i) else {
            return Err(format!("prompt column '{name}' is null"));
        };
        if text.is_empty()
            && self
                .opts
                .score
                .is_none_or(|o| o.shape == ScoreShape::Rolling)
        {
            // a scored continuation's context may be empty: the prefix token stands for it
            return Err(format!("prompt column '{name}' is empty"));
        }
        self.opts
            .text_limit
            .check("prompt has", text.len(), || text.chars().count())?;
        if self.opts.apply_chat_template {
            let msgs = vec![vec![
                ("role".to_string(), Some("user".to_string())),
                ("content".to_string(), Some(text.to_string())),
            ]];
            self.render(&msgs).map(|t| (t, false))
        } else {
            let prefix = self.opts.pool.as_ref().map_or("", |p| p.prefix.as_str());
            Ok((format!("{prefix}{text}"), self.opts.add_special_tokens))
        }
    }

    /// Renders the chat template, its output bounded by the text limit in bytes (characters
    /// <= bytes, so no rendered text over the character limit reaches the tokenizer).
    fn render(&mut self, messages: &[Message]) -> RowResult<String> {
        let limit = self.opts.text_limit;
        let template = self.opts.template.as_mut().ok_or_else(|| {
            "no chat template available: the model has none; name one with \
                 model_chat_template"
                .to_string()
        })?;
        // a pooled row scores the conversation as it is: no generation prompt after it
        let generation_prompt = self.opts.pool.is_none();
        let rendered = template.render(
            messages,
            generation_prompt,
            self.opts.bos_token.as_deref(),
            self.opts.eos_token.as_deref(),
            limit.max_chars,
        );
        rendered.map_err(|e| match e {
            RenderError::Template(e) => e.to_string(),
            RenderError::OutputTooLong => format!(
                "chat template output exceeds {} bytes: {}; it was not tokenized",
                limit.max_chars,
                limit.reason()
            ),
            RenderError::OutOfFuel(n) => format!(
                "chat template ran too long: it executed more than {n} template instructions \
                 (a loop that does not end?)"
            ),
            RenderError::OutOfMemory(n) => crate::chat_template::memory_message(n),
        })
    }

    /// Token ids per row (or the row's error). Rendered chats are encoded without special
    /// tokens (like transformers' `apply_chat_template(tokenize=True)`), raw prompts with them.
    fn tokenize(&self, rows: &[PendingRow]) -> Vec<std::result::Result<Vec<u32>, String>> {
        let mut out: Vec<std::result::Result<Vec<u32>, String>> = rows
            .iter()
            .map(|r| match &r.input {
                Ok(_) => Ok(Vec::new()),
                Err(e) => Err(e.clone()),
            })
            .collect();
        for add_special in [true, false] {
            let idx: Vec<usize> = rows
                .iter()
                .enumerate()
                .filter(|(_, r)| matches!(&r.input, Ok((_, a)) if *a == add_special))
                .map(|(i, _)| i)
                .collect();
            if idx.is_empty() {
                continue;
            }
            let texts: Vec<&str> = idx
                .iter()
                .map(|&i| match &rows[i].input {
                    Ok((t, _)) => t.as_str(),
                    Err(_) => unreachable!("filtered above"),
                })
                .collect();
            let tok = &self.opts.tokenizer;
            match tok.encode_batch_fast(texts.clone(), add_special) {
                Ok(encodings) => {
                    for (&i, enc) in idx.iter().zip(encodings) {
                        out[i] = Ok(enc.get_ids().to_vec());
                    }
                }
                // One bad row fails the whole batch: redo row by row to find it.
                Err(_) => {
                    for (&i, text) in idx.iter().zip(texts) {
                        out[i] = tok
                            .encode_fast(text, add_special)
                            .map(|enc| enc.get_ids().to_vec())
                            .map_err(|e| format!("tokenizer error: {e}"));
                    }
                }
            }
        }
        for ids in out.iter_mut() {
            if matches!(ids, Ok(v) if v.is_empty()) {
                *ids = Err("prompt tokenized to 0 tokens".to_string());
            }
        }
        out
    }
}

/// Row `i` of each kept column, copied out of the batch (a slice would keep the whole batch
/// alive as long as the row runs).
fn kept_values(kept: &[ArrayRef], i: usize) -> std::result::Result<Vec<ArrayRef>, Stop> {
    let index = arrow_array::UInt32Array::from(vec![i as u32]);
    kept.iter()
        .map(|a| arrow_select::take::take(a.as_ref(), &index, None))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| Stop::Failed(Error::internal(format!("output.keep_columns: {e}"))))
}

/// A 64-bit hash of the id at `i` (None when null). Equal values hash equally; distinct ids
/// collide with probability about n^2 / 2^65 over n rows.
fn id_hash(a: &dyn Array, i: usize) -> Option<u64> {
    if a.is_null(i) {
        return None;
    }
    let mut h = std::hash::DefaultHasher::new();
    match a.data_type() {
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => str_value(a, i)?.hash(&mut h),
        DataType::Binary => a.as_binary::<i32>().value(i).hash(&mut h),
        DataType::LargeBinary => a.as_binary::<i64>().value(i).hash(&mut h),
        DataType::BinaryView => a.as_binary_view().value(i).hash(&mut h),
        DataType::Boolean => a.as_boolean().value(i).hash(&mut h),
        dt => {
            // Fixed-width primitives: the value's bytes.
            let width = dt.primitive_width()?;
            let data = a.to_data();
            let start = (data.offset() + i) * width;
            data.buffers().first()?.as_slice()[start..start + width].hash(&mut h)
        }
    }
    Some(h.finish())
}

/// Messages of row `i` of a `list<struct<role, content>>` column; the error names what is
/// malformed, or says the contents are too long for `limit` (checked before they are copied).
fn parse_messages(col: &dyn Array, i: usize, limit: &TextLimit) -> RowResult<Vec<Message>> {
    let malformed = |e: String| format!("malformed messages: {e}");
    let (role, content) = message_fields(col, i).map_err(malformed)?;
    let mut pairs = Vec::with_capacity(role.len());
    for j in 0..role.len() {
        let r = role[j].ok_or_else(|| malformed(format!("message {j} has no role")))?;
        let c = content[j].ok_or_else(|| malformed(format!("message {j} has null content")))?;
        pairs.push((r, c));
    }
    let bytes = pairs.iter().map(|(_, c)| c.len()).sum();
    let chars = || pairs.iter().map(|(_, c)| c.chars().count()).sum();
    limit.check("messages' content has", bytes, chars)?;
    Ok(pairs
        .into_iter()
        .map(|(r, c)| {
            vec![
                ("role".to_string(), Some(r.to_string())),
                ("content".to_string(), Some(c.to_string())),
            ]
        })
        .collect())
}

/// The role and content of each message of row `i` (None where null), borrowed.
type MessageFields<'a> = (Vec<Option<&'a str>>, Vec<Option<&'a str>>);

fn message_fields(col: &dyn Array, i: usize) -> RowResult<MessageFields<'_>> {
    let (values, range) = match col.data_type() {
        DataType::List(_) => {
            let l = col.as_list::<i32>();
            let o = l.value_offsets();
            (l.values(), o[i] as usize..o[i + 1] as usize)
        }
        DataType::LargeList(_) => {
            let l = col.as_list::<i64>();
            let o = l.value_offsets();
            (l.values(), o[i] as usize..o[i + 1] as usize)
        }
        other => return Err(format!("unsupported type {other}")),
    };
    if range.is_empty() {
        return Err("empty list".into());
    }
    let items: &StructArray = values
        .as_struct_opt()
        .ok_or_else(|| "list items are not structs".to_string())?;
    let field = |name: &str| {
        items
            .column_by_name(name)
            .ok_or_else(|| format!("no '{name}' field"))
    };
    let (role, content) = (field("role")?, field("content")?);
    let mut roles = Vec::with_capacity(range.len());
    let mut contents = Vec::with_capacity(range.len());
    for (j, k) in range.enumerate() {
        if items.is_null(k) {
            return Err(format!("message {j} is null"));
        }
        roles.push(str_value(role.as_ref(), k));
        contents.push(str_value(content.as_ref(), k));
    }
    Ok((roles, contents))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RunConfig;
    use crate::testutil::{corrupt_row_group, word_level_tokenizer, write_parquet, TempDir};
    use arrow_array::builder::{ListBuilder, StringBuilder, StructBuilder};
    use arrow_array::{Int32Array, StringArray};
    use arrow_schema::{Field, Fields};

    fn cfg(files: Vec<PathBuf>) -> RunConfig {
        RunConfig::new(
            files,
            "prompt",
            PathBuf::from("unused"),
            PathBuf::from("unused"),
        )
    }

    fn collect(spec: InputSpec, template: Option<&str>, apply: bool, queue: usize) -> Vec<Request> {
        collect_skipping(spec, template, apply, queue, Vec::new())
    }

    fn collect_skipping(
        spec: InputSpec,
        template: Option<&str>,
        apply: bool,
        queue: usize,
        skip_rows: Vec<i64>,
    ) -> Vec<Request> {
        let mut opts = options(template, apply, 4096);
        opts.queue_rows = queue;
        opts.skip_rows = skip_rows;
        read_all(spec, opts)
            .into_iter()
            .map(|m| match m {
                ReaderMsg::Request(r) => r,
                ReaderMsg::Failed(e) => panic!("reader failed: {e}"),
            })
            .collect()
    }

    /// Reader options over the word-level tokenizer (longest token "<unk>": 5 characters).
    fn options(template: Option<&str>, apply: bool, max_model_len: usize) -> ReaderOptions {
        let tokenizer = Arc::new(word_level_tokenizer(64));
        ReaderOptions {
            text_limit: TextLimit::new(&tokenizer, max_model_len),
            tokenizer,
            template: template.map(|t| ChatTemplate::new(t).unwrap()),
            apply_chat_template: apply,
            bos_token: Some("<bos>".into()),
            eos_token: None,
            read_batch_rows: 2,
            queue_rows: 16,
            skip_rows: Vec::new(),
            sampling: Arc::new(cfg(vec![]).sampling_params()),
            n: 1,
            add_special_tokens: true,
            score: None,
            pool: None,
        }
    }

    fn read_all(spec: InputSpec, opts: ReaderOptions) -> Vec<ReaderMsg> {
        let (rx, handle) = spawn_reader(spec, opts).unwrap();
        let out = rx.iter().collect();
        handle.join().unwrap();
        out
    }

    #[test]
    fn messages_name_the_key_the_column_and_the_file_in_pyarrows_spelling() {
        let dir = TempDir::new("reader-keys");
        let f = dir.path().join("a.parquet");
        write_parquet(
            &f,
            vec![("prompt", Arc::new(Int32Array::from(vec![1])) as ArrayRef)],
            10,
        );
        let err = validate_inputs(&cfg(vec![f.clone()]))
            .unwrap_err()
            .to_string();
        let want = format!(
            "input.prompt_column: column 'prompt' in {} has type int32, expected a string",
            f.display()
        );
        assert_eq!(err, want);
        let mut c = cfg(vec![f.clone()]);
        c.input.prompt_column = Some("text".into());
        let err = validate_inputs(&c).unwrap_err().to_string();
        let want = format!(
            "input.prompt_column: column 'text' not found in {} (columns: prompt)",
            f.display()
        );
        assert_eq!(err, want);
        // An unknown sampling key is named before any column is looked for.
        c.input.sampling_columns =
            std::collections::BTreeMap::from([("temprature".into(), "nope".into())]);
        let err = validate_inputs(&c).unwrap_err().to_string();
        assert!(
            err.starts_with("input.sampling_columns: unknown key 'temprature'"),
            "{err}"
        );
        let g = dir.path().join("b.parquet");
        let stops = Arc::new(Int32Array::from(vec![1])) as ArrayRef;
        let prompts = Arc::new(StringArray::from(vec!["w4"])) as ArrayRef;
        write_parquet(&g, vec![("prompt", prompts), ("s", stops)], 10);
        let mut c = cfg(vec![g.clone()]);
        c.input.sampling_columns = std::collections::BTreeMap::from([("stop".into(), "s".into())]);
        let err = validate_inputs(&c).unwrap_err().to_string();
        let want = format!(
            "input.sampling_columns.stop: column 's' in {} has type int32, expected a string \
             or list<string>",
            g.display()
        );
        assert_eq!(err, want);
    }

    #[test]
    fn keep_all_columns_resolves_from_the_first_file_and_clashes_name_the_star() {
        let dir = TempDir::new("reader-keep-all");
        let f = dir.path().join("a.parquet");
        let col = |v: &[&str]| Arc::new(StringArray::from(v.to_vec())) as ArrayRef;
        write_parquet(
            &f,
            vec![
                ("prompt", col(&["w4"])),
                ("id", col(&["x"])),
                ("note", col(&["n"])),
            ],
            10,
        );
        let mut c = cfg(vec![f.clone()]);
        c.input.id_column = Some("id".into());
        let spec = check_job_inputs(&mut c, true).unwrap();
        let kept: Vec<&str> = spec.kept.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(kept, ["prompt", "note"]); // the id column named `id` is the output's id
        let g = dir.path().join("b.parquet");
        write_parquet(
            &g,
            vec![("prompt", col(&["w4"])), ("error", col(&["e"]))],
            10,
        );
        let mut c = cfg(vec![g]);
        let err = check_job_inputs(&mut c, true).unwrap_err().to_string();
        assert!(
            err.starts_with("output.keep_columns: column 'error' clashes")
                && err.ends_with("(list the columns to keep instead of \"*\")"),
            "{err}"
        );
        let mut c = cfg(vec![f]);
        c.output.keep_columns = vec!["error".into()];
        let err = check_job_inputs(&mut c, false).unwrap_err().to_string();
        assert!(
            err.contains("'error' clashes") && !err.contains("\"*\""),
            "{err}"
        );
    }

    #[test]
    fn missing_file_and_column_are_user_errors() {
        let dir = TempDir::new("reader-missing");
        let err = validate_inputs(&cfg(vec![dir.path().join("nope.parquet")])).unwrap_err();
        assert!(
            matches!(&err, Error::UserInput(m) if m.contains("nope.parquet")),
            "{err}"
        );

        let f = dir.path().join("a.parquet");
        write_parquet(
            &f,
            vec![("text", Arc::new(StringArray::from(vec!["w4"])) as ArrayRef)],
            10,
        );
        let err = validate_inputs(&cfg(vec![f.clone()])).unwrap_err();
        assert!(
            matches!(&err, Error::UserInput(m) if m.contains("a.parquet") && m.contains("'prompt'") && m.contains("text")),
            "{err}"
        );

        let g = dir.path().join("b.parquet");
        write_parquet(
            &g,
            vec![("prompt", Arc::new(Int32Array::from(vec![1])) as ArrayRef)],
            10,
        );
        let err = validate_inputs(&cfg(vec![g])).unwrap_err();
        assert!(
            matches!(&err, Error::UserInput(m) if m.contains("expected a string")),
            "{err}"
        );

        let h = dir.path().join("c.parquet");
        std::fs::write(&h, b"not parquet at all").unwrap();
        let err = validate_inputs(&cfg(vec![h])).unwrap_err();
        assert!(
            matches!(&err, Error::UserInput(m) if m.contains("c.parquet")),
            "{err}"
        );
    }

    #[test]
    fn a_column_read_twice_is_refused_not_picked() {
        let dir = TempDir::new("reader-dup");
        let s = |v: &str| Arc::new(StringArray::from(vec![v])) as ArrayRef;
        let f = dir.path().join("dup.parquet");
        write_parquet(
            &f,
            vec![("prompt", s("w4")), ("cont", s("w5")), ("cont", s("w6"))],
            10,
        );
        let g = dir.path().join("dup-prompt.parquet");
        write_parquet(&g, vec![("prompt", s("w4")), ("prompt", s("w5"))], 10);
        let twice = |c: &RunConfig, col: &str| {
            let err = validate_inputs(c).unwrap_err();
            assert!(
                matches!(&err, Error::UserInput(m) if m.contains(&format!("column '{col}' \
                    appears twice in")) && m.contains("dup")),
                "{err}"
            );
        };
        twice(&cfg(vec![g]), "prompt");
        let mut c = cfg(vec![f.clone()]);
        c.input.continuation_column = Some("cont".into());
        twice(&c, "cont");
        let mut c = cfg(vec![f.clone()]);
        c.output.keep_columns = vec!["cont".into()];
        twice(&c, "cont");
        let mut c = cfg(vec![f]);
        c.input
            .sampling_columns
            .insert("stop".into(), "cont".into());
        twice(&c, "cont");
    }

    #[test]
    fn id_type_must_match_across_files() {
        let dir = TempDir::new("reader-idtype");
        let a = dir.path().join("a.parquet");
        let b = dir.path().join("b.parquet");
        let p = || Arc::new(StringArray::from(vec!["w4"])) as ArrayRef;
        write_parquet(
            &a,
            vec![("prompt", p()), ("id", Arc::new(Int32Array::from(vec![1])))],
            10,
        );
        write_parquet(
            &b,
            vec![
                ("prompt", p()),
                ("id", Arc::new(StringArray::from(vec!["x"]))),
            ],
            10,
        );
        let mut c = cfg(vec![a, b]);
        c.input.id_column = Some("id".into());
        let err = validate_inputs(&c).unwrap_err();
        assert!(
            matches!(&err, Error::UserInput(m) if m.contains("input.id_column: column 'id' has \
                type int32 in") && m.contains("a.parquet but string in") && m.contains("b.parquet")),
            "{err}"
        );
    }

    /// A one-column file per array, `prompt` w4.. and ids `ids`, in `dir`.
    fn id_files(dir: &TempDir, ids: Vec<ArrayRef>) -> Vec<PathBuf> {
        let mut files = Vec::new();
        for (k, id) in ids.into_iter().enumerate() {
            let path = dir.path().join(format!("{k}.parquet"));
            let words: Vec<String> = (0..id.len()).map(|i| format!("w{}", 4 + i)).collect();
            let prompts = Arc::new(StringArray::from(words)) as ArrayRef;
            write_parquet(&path, vec![("prompt", prompts), ("id", id)], 10);
            files.push(path);
        }
        files
    }

    #[test]
    fn string_ids_of_any_spelling_and_dictionaries_are_written_as_one_type() {
        use arrow_array::types::Int8Type;
        use arrow_array::{DictionaryArray, LargeStringArray, StringViewArray};
        let dir = TempDir::new("reader-idmix");
        let dict: DictionaryArray<Int8Type> = vec!["c", "d", "c"].into_iter().collect();
        let ids: Vec<ArrayRef> = vec![
            Arc::new(StringArray::from(vec!["a"])),
            Arc::new(LargeStringArray::from(vec!["b"])),
            Arc::new(dict),
            Arc::new(StringViewArray::from(vec!["e"])),
        ];
        let mut c = cfg(id_files(&dir, ids));
        c.input.id_column = Some("id".into());
        let spec = validate_inputs(&c).unwrap();
        assert_eq!(spec.id_type, DataType::LargeUtf8);
        let reqs = collect(spec, None, false, 16);
        let read: Vec<(&str, Option<&str>)> = reqs
            .iter()
            .map(|r| (r.id.as_string::<i64>().value(0), r.error.as_deref()))
            .collect();
        let dup = "duplicate id: an earlier row has the same value in id column 'id' (only \
                   the first row with an id is generated)";
        let want = [
            ("a", None),
            ("b", None),
            ("c", None),
            ("d", None),
            ("c", Some(dup)),
        ];
        assert_eq!(read, [&want[..], &[("e", None)]].concat());
    }

    #[test]
    fn a_dictionary_id_alone_is_written_as_its_values() {
        use arrow_array::types::UInt32Type;
        use arrow_array::DictionaryArray;
        let dir = TempDir::new("reader-iddict");
        let dict: DictionaryArray<UInt32Type> = vec![Some("x"), None].into_iter().collect();
        let mut c = cfg(id_files(&dir, vec![Arc::new(dict)]));
        c.input.id_column = Some("id".into());
        let spec = validate_inputs(&c).unwrap();
        assert_eq!(spec.id_type, DataType::Utf8);
        let reqs = collect(spec, None, false, 16);
        assert_eq!(reqs[0].id.as_string::<i32>().value(0), "x");
        assert!(reqs[1].id.is_null(0));
        assert_eq!(reqs[1].error.as_deref(), Some("id column 'id' is null"));
    }

    #[test]
    fn integer_ids_of_any_width_are_written_as_int64_but_uint64_mixes_with_none() {
        use arrow_array::{UInt64Array, UInt8Array};
        let dir = TempDir::new("reader-intmix");
        let narrow: Vec<ArrayRef> = vec![
            Arc::new(Int32Array::from(vec![-1])),
            Arc::new(UInt8Array::from(vec![200])),
        ];
        let mut c = cfg(id_files(&dir, narrow));
        c.input.id_column = Some("id".into());
        let spec = validate_inputs(&c).unwrap();
        assert_eq!(spec.id_type, DataType::Int64);
        let ids: Vec<i64> = collect(spec, None, false, 16)
            .iter()
            .map(|r| {
                r.id.as_primitive::<arrow_array::types::Int64Type>()
                    .value(0)
            })
            .collect();
        assert_eq!(ids, vec![-1, 200]);
        let wide = TempDir::new("reader-u64mix");
        let mix: Vec<ArrayRef> = vec![
            Arc::new(Int32Array::from(vec![1])),
            Arc::new(UInt64Array::from(vec![u64::MAX])),
        ];
        c.input.input_files = id_files(&wide, mix);
        let err = validate_inputs(&c).unwrap_err().to_string();
        assert!(
            err.contains("int32 in") && err.contains("but uint64 in"),
            "{err}"
        );
        assert!(err.contains("uint64 only with uint64"), "{err}");
    }

    #[test]
    fn dictionary_prompts_and_messages_are_read_as_strings() {
        use arrow_array::types::Int32Type;
        use arrow_array::DictionaryArray;
        let dir = TempDir::new("reader-dicttext");
        let a = dir.path().join("p.parquet");
        let prompts: DictionaryArray<Int32Type> = vec![Some("w4 w5"), None, Some("w4 w5")]
            .into_iter()
            .collect();
        write_parquet(&a, vec![("prompt", Arc::new(prompts) as ArrayRef)], 10);
        let reqs = collect(validate_inputs(&cfg(vec![a])).unwrap(), None, false, 16);
        assert_eq!(reqs[0].prompt_ids, vec![1, 4, 5]);
        assert_eq!(reqs[2].prompt_ids, vec![1, 4, 5]);
        assert!(reqs[1].error.as_deref().unwrap().contains("is null"));

        let m = dir.path().join("m.parquet");
        write_parquet(&m, vec![("messages", dictionary_messages())], 10);
        let mut c = cfg(vec![m]);
        c.input.prompt_column = None;
        c.input.messages_column = Some("messages".into());
        let tmpl = "{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}";
        let reqs = collect(validate_inputs(&c).unwrap(), Some(tmpl), false, 16);
        assert_eq!(reqs[0].prompt_ids, vec![9, 5, 6]);
        assert_eq!(reqs[1].prompt_ids, vec![9, 7]);
    }

    /// Two rows of one message each, role and content dictionary-encoded strings.
    fn dictionary_messages() -> ArrayRef {
        use arrow_array::builder::{ArrayBuilder, StringDictionaryBuilder};
        use arrow_array::types::Int8Type;
        type Dict = StringDictionaryBuilder<Int8Type>;
        let dict = DataType::Dictionary(Box::new(DataType::Int8), Box::new(DataType::Utf8));
        let fields = Fields::from(vec![
            Field::new("role", dict.clone(), true),
            Field::new("content", dict, true),
        ]);
        let builders: Vec<Box<dyn ArrayBuilder>> =
            vec![Box::new(Dict::new()), Box::new(Dict::new())];
        let mut lb = ListBuilder::new(StructBuilder::new(fields, builders));
        for content in ["w5 w6", "w7"] {
            let s = lb.values();
            s.field_builder::<Dict>(0).unwrap().append_value("w9");
            s.field_builder::<Dict>(1).unwrap().append_value(content);
            s.append(true);
            lb.append(true);
        }
        Arc::new(lb.finish())
    }

    #[test]
    fn streams_rows_in_order_with_limit_errors_and_ids() {
        let dir = TempDir::new("reader-stream");
        let a = dir.path().join("a.parquet");
        let b = dir.path().join("b.parquet");
        write_parquet(
            &a,
            vec![
                (
                    "prompt",
                    Arc::new(StringArray::from(vec![Some("w4 w5"), None, Some("")])) as ArrayRef,
                ),
                ("id", Arc::new(StringArray::from(vec!["a0", "a1", "a2"]))),
            ],
            2,
        );
        write_parquet(
            &b,
            vec![
                (
                    "prompt",
                    Arc::new(StringArray::from(vec!["w6", "w7", "w8"])) as ArrayRef,
                ),
                ("id", Arc::new(StringArray::from(vec!["b0", "b1", "b2"]))),
            ],
            2,
        );
        let mut c = cfg(vec![a, b]);
        c.input.id_column = Some("id".into());
        c.input.limit = Some(5);
        let spec = validate_inputs(&c).unwrap();
        assert_eq!(spec.total_rows, 5);
        assert_eq!(spec.id_type, DataType::Utf8);
        let reqs = collect(spec, None, false, 1);
        assert_eq!(reqs.len(), 5);
        let idx: Vec<i64> = reqs.iter().map(|r| r.row_index).collect();
        assert_eq!(idx, vec![0, 1, 2, 3, 4]);
        let ids: Vec<String> = reqs
            .iter()
            .map(|r| r.id.as_string::<i32>().value(0).to_string())
            .collect();
        assert_eq!(ids, vec!["a0", "a1", "a2", "b0", "b1"]);
        // Raw prompts get special tokens (<bos> = 1) from the post-processor.
        assert_eq!(reqs[0].prompt_ids, vec![1, 4, 5]);
        assert!(reqs[1].error.as_deref().unwrap().contains("null"));
        assert!(reqs[2].error.as_deref().unwrap().contains("empty"));
        assert_eq!(reqs[4].prompt_ids, vec![1, 7]);
    }

    #[test]
    fn skipped_rows_and_duplicate_or_null_ids() {
        let dir = TempDir::new("reader-skip");
        let a = dir.path().join("a.parquet");
        let ids = Int32Array::from(vec![Some(7), Some(8), Some(7), None, Some(9), Some(8)]);
        write_parquet(
            &a,
            vec![
                (
                    "prompt",
                    Arc::new(StringArray::from(vec!["w4"; 6])) as ArrayRef,
                ),
                ("id", Arc::new(ids)),
            ],
            4,
        );
        let mut c = cfg(vec![a]);
        c.input.id_column = Some("id".into());
        let spec = validate_inputs(&c).unwrap();
        let all = collect(spec.clone(), None, false, 16);
        let errors: Vec<Option<&str>> = all.iter().map(|r| r.error.as_deref()).collect();
        assert!(errors[0].is_none() && errors[1].is_none() && errors[4].is_none());
        assert!(errors[2].unwrap().contains("duplicate id"), "{errors:?}");
        assert!(errors[5].unwrap().contains("duplicate id"));
        assert!(errors[3].unwrap().contains("'id' is null"));
        // Skipping rows 0 and 1 (done earlier) still counts their ids as seen.
        let rest = collect_skipping(spec, None, false, 16, vec![0, 1, 4]);
        let idx: Vec<i64> = rest.iter().map(|r| r.row_index).collect();
        assert_eq!(idx, vec![2, 3, 5]);
        assert!(rest[0].error.as_deref().unwrap().contains("duplicate id"));
        assert!(rest[2].error.as_deref().unwrap().contains("duplicate id"));
    }

    /// Two files of three rows (row groups of two), ids x y z | x w y: rows 3 and 5 repeat
    /// ids of rows 0 and 1.
    fn two_files_with_duplicate_ids(dir: &TempDir) -> Vec<PathBuf> {
        let mut files = Vec::new();
        for (name, ids) in [("a", ["x", "y", "z"]), ("b", ["x", "w", "y"])] {
            let path = dir.path().join(format!("{name}.parquet"));
            let prompts = StringArray::from(vec!["w4 w5", "w6", "w7 w8"]);
            write_parquet(
                &path,
                vec![
                    ("prompt", Arc::new(prompts) as ArrayRef),
                    ("id", Arc::new(StringArray::from(ids.to_vec()))),
                ],
                2,
            );
            files.push(path);
        }
        files
    }

    #[test]
    fn row_ranges_partition_the_rows_and_judge_ids_as_a_whole_run() {
        let dir = TempDir::new("reader-range");
        let files = two_files_with_duplicate_ids(&dir);
        let view = |r: &Request| (r.row_index, r.prompt_ids.clone(), r.error.clone());
        for id_column in [None, Some("id".to_string())] {
            let mut c = cfg(files.clone());
            c.input.id_column = id_column.clone();
            let whole: Vec<_> = collect(validate_inputs(&c).unwrap(), None, false, 16)
                .iter()
                .map(view)
                .collect();
            assert_eq!(whole.len(), 6);
            assert_eq!(whole[3].2.is_some(), id_column.is_some(), "{whole:?}");
            for n in 1..=8u64 {
                let mut joined = Vec::new();
                for i in 0..n {
                    c.input.row_range = Some((i * 6 / n, (i + 1) * 6 / n));
                    let spec = validate_inputs(&c).unwrap();
                    assert_eq!(spec.range_rows(), (i + 1) * 6 / n - i * 6 / n);
                    joined.extend(collect(spec, None, false, 16).iter().map(view));
                }
                assert_eq!(joined, whole, "{n} ranges, id column {id_column:?}");
            }
        }
    }

    #[test]
    fn a_range_past_the_limit_is_clipped() {
        let dir = TempDir::new("reader-range-limit");
        let mut c = cfg(two_files_with_duplicate_ids(&dir));
        c.input.limit = Some(4);
        c.input.row_range = Some((3, 10));
        let spec = validate_inputs(&c).unwrap();
        assert_eq!((spec.row_start, spec.row_end), (3, 4));
        let rows = collect(spec, None, false, 16);
        assert_eq!(
            rows.iter().map(|r| r.row_index).collect::<Vec<_>>(),
            vec![3]
        );
        c.input.row_range = Some((5, 9));
        let spec = validate_inputs(&c).unwrap();
        assert_eq!(spec.range_rows(), 0);
        assert!(collect(spec, None, false, 16).is_empty());
        c.input.row_range = Some((2, 1));
        assert!(c.validate().is_err());
    }

    /// (role, content) pairs per row; `None` = null list.
    type MessageRows<'a> = Vec<Option<Vec<(Option<&'a str>, Option<&'a str>)>>>;

    fn messages_array(rows: MessageRows<'_>) -> ArrayRef {
        let fields = Fields::from(vec![
            Field::new("role", DataType::Utf8, true),
            Field::new("content", DataType::Utf8, true),
        ]);
        let sb = StructBuilder::from_fields(fields, 0);
        let mut lb = ListBuilder::new(sb);
        for row in rows {
            match row {
                None => lb.append(false),
                Some(msgs) => {
                    for (role, content) in msgs {
                        let s = lb.values();
                        s.field_builder::<StringBuilder>(0)
                            .unwrap()
                            .append_option(role);
                        s.field_builder::<StringBuilder>(1)
                            .unwrap()
                            .append_option(content);
                        s.append(true);
                    }
                    lb.append(true);
                }
            }
        }
        Arc::new(lb.finish())
    }

    #[test]
    fn messages_are_rendered_without_special_tokens() {
        let dir = TempDir::new("reader-msgs");
        let a = dir.path().join("m.parquet");
        let col = messages_array(vec![
            Some(vec![(Some("user"), Some("w5 w6"))]),
            None,
            Some(vec![(Some("user"), None)]),
            Some(vec![]),
        ]);
        write_parquet(&a, vec![("messages", col)], 10);
        let mut c = cfg(vec![a]);
        c.input.prompt_column = None;
        c.input.messages_column = Some("messages".into());
        let spec = validate_inputs(&c).unwrap();
        assert_eq!(spec.id_type, DataType::Int64);
        let tmpl = "{{ bos_token }}{% for m in messages %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}w9{% endif %}";
        let reqs = collect(spec, Some(tmpl), false, 16);
        assert_eq!(reqs.len(), 4);
        // "<bos>w5 w6 w9": bos from the template, none added by the tokenizer.
        assert_eq!(reqs[0].prompt_ids, vec![1, 5, 6, 9]);
        assert_eq!(
            reqs[0]
                .id
                .as_primitive::<arrow_array::types::Int64Type>()
                .value(0),
            0
        );
        assert!(reqs[1].error.as_deref().unwrap().contains("null"));
        assert!(reqs[2]
            .error
            .as_deref()
            .unwrap()
            .contains("malformed messages"));
        assert!(reqs[3].error.as_deref().unwrap().contains("empty list"));
    }

    #[test]
    fn apply_chat_template_to_prompts() {
        let dir = TempDir::new("reader-apply");
        let a = dir.path().join("p.parquet");
        write_parquet(
            &a,
            vec![(
                "prompt",
                Arc::new(StringArray::from(vec!["w7"])) as ArrayRef,
            )],
            10,
        );
        let spec = validate_inputs(&cfg(vec![a])).unwrap();
        let tmpl = "{% for m in messages %}{% if m.role == 'user' %}w10{% endif %} {{ m.content }} {% endfor %}";
        let reqs = collect(spec, Some(tmpl), true, 16);
        assert_eq!(reqs[0].prompt_ids, vec![10, 7]);
    }

    /// The row errors (None: tokenized) of `prompts` read with the given options.
    fn row_errors(spec: InputSpec, opts: ReaderOptions) -> Vec<(Option<String>, usize)> {
        read_all(spec, opts)
            .into_iter()
            .map(|m| match m {
                ReaderMsg::Request(r) => (r.error, r.prompt_ids.len()),
                ReaderMsg::Failed(e) => panic!("reader failed: {e}"),
            })
            .collect()
    }

    #[test]
    fn a_prompt_too_long_for_max_model_len_is_refused_before_tokenizing() {
        let dir = TempDir::new("reader-long");
        let a = dir.path().join("p.parquet");
        let at_limit = format!("{}w5", "w5 ".repeat(26)); // 80 characters
        let over = "w5 ".repeat(27); // 81
        let multibyte = format!("{}w5", "é".repeat(40)); // 82 bytes, 42 characters
        let col = StringArray::from(vec![at_limit.as_str(), over.as_str(), multibyte.as_str()]);
        write_parquet(&a, vec![("prompt", Arc::new(col) as ArrayRef)], 10);
        let spec = validate_inputs(&cfg(vec![a])).unwrap();
        // Longest token "<unk>": 5 characters; 4 x 5 x max_model_len 4 = 80 characters.
        let opts = options(None, false, 4);
        assert_eq!(opts.text_limit.max_chars, 80);
        let rows = row_errors(spec, opts);
        assert_eq!(rows[0], (None, 28));
        assert_eq!(
            rows[1].0.as_deref().unwrap(),
            "prompt has 81 characters: more than 80 characters cannot fit max_model_len = 4 \
             tokens (no token of this tokenizer is longer than 5 characters; the limit is 4 x 5 \
             x 4); it was not tokenized"
        );
        assert_eq!(rows[1].1, 0);
        assert_eq!(rows[2], (None, 2)); // <bos> and one unknown word
    }

    #[test]
    fn chat_rows_over_the_limits_are_error_rows() {
        let dir = TempDir::new("reader-long-chat");
        let a = dir.path().join("m.parquet");
        let (half, rest) = ("w5 ".repeat(13) + "w", "w5 ".repeat(13) + "w5");
        let col = messages_array(vec![
            Some(vec![
                (Some("user"), Some(half.as_str())),
                (Some("user"), Some(&rest)),
            ]),
            Some(vec![(Some("user"), Some(&rest[..40]))]),
            Some(vec![(Some("user"), Some("loop"))]),
            Some(vec![(Some("user"), Some("w6 w7"))]),
        ]);
        write_parquet(&a, vec![("messages", col)], 10);
        let mut c = cfg(vec![a]);
        c.input.prompt_column = None;
        c.input.messages_column = Some("messages".into());
        let spec = validate_inputs(&c).unwrap();
        // Twice each content: the rendered text is twice the content; "loop" never ends.
        let tmpl = "{% for m in messages %}{{ m.content }} {{ m.content }} {% endfor %}\
                    {% if messages[0].content == 'loop' %}{% for i in range(100000) %}\
                    {% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}";
        let rows = row_errors(spec, options(Some(tmpl), false, 4));
        let err = |i: usize| rows[i].0.clone().unwrap_or_default();
        assert!(
            err(0).starts_with("messages' content has 81 characters: more than 80"),
            "{}",
            err(0)
        );
        assert!(
            err(1).starts_with("chat template output exceeds 80 bytes: more than 80 characters"),
            "{}",
            err(1)
        );
        assert!(
            err(2).starts_with("chat template ran too long"),
            "{}",
            err(2)
        );
        assert_eq!(rows[3], (None, 4));
    }

    #[test]
    fn a_corrupt_row_group_is_a_user_error_naming_it() {
        let dir = TempDir::new("reader-corrupt");
        let a = dir.path().join("c.parquet");
        let col = StringArray::from(vec!["w4", "w5", "w6", "w7", "w8"]);
        write_parquet(&a, vec![("prompt", Arc::new(col) as ArrayRef)], 2);
        corrupt_row_group(&a, 1);
        let spec = validate_inputs(&cfg(vec![a])).unwrap();
        let msgs = read_all(spec, options(None, false, 64));
        assert_eq!(msgs.len(), 3, "rows 0 and 1, then the failure");
        assert!(matches!(&msgs[1], ReaderMsg::Request(r) if r.row_index == 1));
        match &msgs[2] {
            ReaderMsg::Failed(Error::UserInput(m)) => assert!(
                m.contains("c.parquet, row group 1: the input file is corrupt or unreadable"),
                "{m}"
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn directory_input_is_a_user_error() {
        let dir = TempDir::new("reader-dir");
        for name in ["b.parquet", "_a.parquet"] {
            write_parquet(
                &dir.path().join(name),
                vec![(
                    "prompt",
                    Arc::new(StringArray::from(vec!["w4", "w5"])) as ArrayRef,
                )],
                10,
            );
        }
        // The Python side resolves directories; Rust accepts only files.
        let err = validate_inputs(&cfg(vec![dir.path().to_path_buf()])).unwrap_err();
        assert!(matches!(err, Error::UserInput(_)), "{err:?}");
        let msg = err.to_string();
        assert!(
            msg.contains("is a directory; pass its files (the Python side resolves directories)"),
            "{msg}"
        );
        // Also when it follows a valid file.
        let file = dir.path().join("b.parquet");
        let err = validate_inputs(&cfg(vec![file.clone(), dir.path().to_path_buf()])).unwrap_err();
        assert!(err.to_string().contains("is a directory"), "{err}");
        // An explicitly named file is read even with a leading underscore.
        let named = dir.path().join("_a.parquet");
        let spec = validate_inputs(&cfg(vec![file, named])).unwrap();
        assert_eq!(spec.files.len(), 2);
        assert!(spec.files[1].path.ends_with("_a.parquet"));
        assert_eq!(spec.total_rows, 4);
    }
}
