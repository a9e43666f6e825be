//! Output side: a background thread that buffers finished rows and writes ZSTD Parquet part
//! files `part-NNNNN.parquet` into the output directory.
//!
//! Invariants:
//! - each row handed to `Writer::send` is written exactly once, in the order received;
//! - a part file becomes visible only complete: it is written as `.part-NNNNN.parquet.tmp`,
//!   closed (footer), fsynced, renamed, and the directory is fsynced; on an object store it is
//!   one create-only PUT under its final name (remote_parts.rs);
//! - numbering starts after the highest existing `part-N.parquet`, so earlier results in the
//!   same directory are never overwritten;
//! - a part is closed when it has `part_rows` rows, when its oldest row has waited
//!   `flush_interval` (if set), and at `finish`: rows are lost only in a crash, and only those
//!   not yet in a closed part;
//! - after `finish` (a complete run), the directory holds at least one part file (an empty one
//!   if no rows and no earlier part), so `pyarrow.parquet.read_table(output_dir)` always works;
//! - after `abort` or a drop without `finish` (a failed or interrupted run), the rows already
//!   sent are in complete part files and no empty part is written;
//! - a part file that fails to be written leaves no `.tmp` file behind.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use arrow_array::builder::{Float64Builder, Int32Builder, ListBuilder, StringBuilder};
use arrow_array::{ArrayRef, Int64Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;

use crate::error::{Error, Result};
use crate::logprobs::LogprobEntry;
use crate::score::{RowScore, ScoreShape};
use crate::sequence::{FinishReason, StopReason};
use tokenizers::Tokenizer;

mod remote_parts;

/// One output row (a finished or failed request).
#[derive(Debug, Clone)]
pub struct OutputRow {
    /// Length-1 array of the output id type.
    pub id: ArrayRef,
    pub row_index: i64,
    /// Which of the row's samples (0 when sampling.n = 1).
    pub sample_index: i32,
    /// How many samples the row has (its n: `sampling.n`, or its batch line's).
    pub num_samples: i32,
    /// Generated text ("" for error rows).
    pub output_text: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: i32,
    pub output_tokens: i32,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: i32,
    pub queue_s: Option<f64>,
    pub ttft_s: Option<f64>,
    pub latency_s: Option<f64>,
    pub tpot_s: Option<f64>,
    pub error: Option<String>,
    pub spec_steps: Option<i32>,
    pub accepted_tokens: Option<i32>,
    pub accept_length: Option<f64>,
    /// What ended a row that stopped other than at EOS: a stop string or a stop token id
    /// (vLLM's `stop_reason`); None for EOS, a length or an error.
    pub stop_reason: Option<StopReason>,
    /// One length-1 array per kept input column (`WriterConfig::kept`, same order and types).
    pub kept: Vec<ArrayRef>,
    /// All generated ids (including a final EOS); written only with `include_token_ids`.
    pub output_token_ids: Vec<u32>,
    /// One entry per output token, for a row that asked for logprobs (else None: null).
    pub logprobs: Option<Vec<LogprobEntry>>,
    /// One entry per prompt token after the first, with `prompt_logprobs`.
    pub prompt_logprobs: Option<Vec<LogprobEntry>>,
    /// A finished row whose text is still to be decoded: these ids, decoded by the writer
    /// thread into `output_text` (so a commit does not pay for finished rows' decodes). A
    /// decode failure makes it an error row there (`WriterSummary::decode_errors`).
    pub text_ids: Option<Vec<u32>>,
    /// A response_format row's output matches its format completely (None: no format, or an
    /// error row).
    pub structured: Option<bool>,
    /// `output.reasoning`: the ids of the row's reasoning, decoded by the writer into
    /// `reasoning_text` like `text_ids` (None: no reasoning column, or an error row).
    pub reasoning_ids: Option<Vec<u32>>,
    pub reasoning_text: Option<String>,
    /// How `text_ids` are decoded: without special tokens (the default), or with them.
    pub skip_special_tokens: bool,
    /// OpenAI Batch input: the url of the row's line, when it named one eaglebatch serves
    /// (written with `WriterConfig::endpoint`).
    pub endpoint: Option<&'static str>,
    /// A scoring task's row scores (None: generation, or an error row).
    pub score: Option<RowScore>,
}

#[derive(Debug, Clone)]
pub struct WriterConfig {
    /// A local directory or an object-store URL (`storage::remote_url`).
    pub output_dir: PathBuf,
    /// How a remote `output_dir` is reached.
    pub storage: crate::storage::StorageSettings,
    pub part_rows: usize,
    pub file_metadata: BTreeMap<String, String>,
    pub include_token_ids: bool,
    /// Write the `logprobs` / `prompt_logprobs` columns (logprobs.rs).
    pub logprobs: bool,
    pub prompt_logprobs: bool,
    /// Write the `structured` column (a row may have a response_format).
    pub structured: bool,
    /// Write the `reasoning_text` column (`output.reasoning`).
    pub reasoning: bool,
    /// Write the `endpoint` and `n` columns (OpenAI Batch input: each line's url and n).
    pub endpoint: bool,
    /// A scoring task: write its score columns (score.rs) in this shape.
    pub score: Option<ScoreShape>,
    /// A pooled task: write its head's columns (pooled.rs).
    pub pooled: Option<Arc<crate::pooled::PoolHead>>,
    pub id_type: DataType,
    /// Kept input columns: (name, output type), written after every other column.
    pub kept: Vec<(String, DataType)>,
    /// Close a part once its oldest row is this old (None: only by `part_rows`).
    pub flush_interval: Option<Duration>,
    /// Decodes rows sent with `text_ids` (required for them).
    pub decoder: Option<Arc<Tokenizer>>,
}

#[derive(Debug, Clone, Default)]
pub struct WriterSummary {
    pub part_files: Vec<PathBuf>,
    pub rows_written: u64,
    /// Time the writer thread spent decoding rows' texts and building and writing parts (off
    /// the step loop's thread).
    pub busy: Duration,
    /// Rows whose text failed to decode, written as error rows.
    pub decode_errors: u64,
}

/// Every column name the output may have (those of `output_schema`, whatever the settings):
/// kept input columns may not take one.
pub const OUTPUT_COLUMNS: &[&str] = &[
    "id",
    "row_index",
    "sample_index",
    "output_text",
    "finish_reason",
    "prompt_tokens",
    "output_tokens",
    "cached_tokens",
    "queue_s",
    "ttft_s",
    "latency_s",
    "tpot_s",
    "error",
    "spec_steps",
    "accepted_tokens",
    "accept_length",
    "stop_reason",
    "stop_token_id",
    "output_token_ids",
    "logprobs",
    "prompt_logprobs",
    "structured",
    "reasoning_text",
    "endpoint",
    "n",
    "logprob",
    "num_tokens",
    "is_greedy",
];

/// Output schema (column order is part of the contract).
pub fn output_schema(cfg: &WriterConfig) -> SchemaRef {
    let (id_type, include_token_ids) = (&cfg.id_type, cfg.include_token_ids);
    let mut fields = vec![
        Field::new("id", id_type.clone(), true),
        Field::new("row_index", DataType::Int64, false),
        Field::new("sample_index", DataType::Int32, false),
        Field::new("output_text", DataType::Utf8, false),
        Field::new("finish_reason", DataType::Utf8, false),
        Field::new("prompt_tokens", DataType::Int32, false),
        Field::new("output_tokens", DataType::Int32, false),
        Field::new("cached_tokens", DataType::Int32, false),
        Field::new("queue_s", DataType::Float64, true),
        Field::new("ttft_s", DataType::Float64, true),
        Field::new("latency_s", DataType::Float64, true),
        Field::new("tpot_s", DataType::Float64, true),
        Field::new("error", DataType::Utf8, true),
        Field::new("spec_steps", DataType::Int32, true),
        Field::new("accepted_tokens", DataType::Int32, true),
        Field::new("accept_length", DataType::Float64, true),
        Field::new("stop_reason", DataType::Utf8, true),
        Field::new("stop_token_id", DataType::Int32, true),
    ];
    if include_token_ids {
        fields.push(Field::new(
            "output_token_ids",
            DataType::List(Arc::new(Field::new("item", DataType::Int32, true))),
            false,
        ));
    }
    if cfg.logprobs {
        fields.push(crate::logprobs::field("logprobs"));
    }
    if cfg.prompt_logprobs {
        fields.push(crate::logprobs::field("prompt_logprobs"));
    }
    if cfg.structured {
        fields.push(Field::new("structured", DataType::Utf8, true));
    }
    if cfg.reasoning {
        fields.push(Field::new("reasoning_text", DataType::Utf8, true));
    }
    if cfg.endpoint {
        fields.push(Field::new("endpoint", DataType::Utf8, true));
        fields.push(Field::new("n", DataType::Int32, false));
    }
    if let Some(shape) = cfg.score {
        fields.extend(crate::score::fields(shape));
    }
    if let Some(head) = &cfg.pooled {
        fields.extend(head.fields());
    }
    for (name, dt) in &cfg.kept {
        fields.push(Field::new(name, dt.clone(), true));
    }
    Arc::new(Schema::new(fields))
}

/// N of a `part-N.parquet` name.
fn part_number(name: &str) -> Option<u64> {
    let num = name.strip_prefix("part-")?.strip_suffix(".parquet")?;
    num.parse().ok()
}

/// Highest N among `part-N.parquet` files in `dir` (None if there are none).
fn highest_part_number(dir: &Path) -> Result<Option<u64>> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io("cannot list", dir, e))?;
    let names = entries.flatten().map(|e| e.file_name());
    Ok(names.filter_map(|n| n.to_str().and_then(part_number)).max())
}

/// Where parts go: the output directory, or (a URL) its object-store prefix.
enum Destination {
    Local,
    Remote(remote_parts::RemoteDir),
}

impl Destination {
    /// Opens (creating a local directory) the output directory; returns the next part number.
    fn open(cfg: &WriterConfig) -> Result<(Destination, u64)> {
        if let Some(url) = crate::storage::remote_url(&cfg.output_dir) {
            let dir = remote_parts::RemoteDir::open(url, &cfg.storage)?;
            let next = dir.highest_part_number()?.map_or(0, |n| n + 1);
            return Ok((Destination::Remote(dir), next));
        }
        std::fs::create_dir_all(&cfg.output_dir).map_err(|e| {
            Error::user(format!(
                "cannot create output directory {}: {e}",
                cfg.output_dir.display()
            ))
        })?;
        let next = highest_part_number(&cfg.output_dir)?.map_or(0, |n| n + 1);
        Ok((Destination::Local, next))
    }
}

/// Handle to the writer thread.
pub struct Writer {
    tx: Option<Sender<OutputRow>>,
    handle: Option<JoinHandle<Result<WriterSummary>>>,
    /// Set by `finish` before the channel closes: the run is complete, so the thread writes an
    /// empty part when the directory would otherwise hold none.
    complete: Arc<AtomicBool>,
}

impl Writer {
    /// Creates the output directory if needed and starts the writer thread.
    pub fn start(cfg: WriterConfig) -> Result<Writer> {
        let (dest, next_part) = Destination::open(&cfg)?;
        let (tx, rx) = crossbeam_channel::bounded(cfg.part_rows.clamp(1, 4096));
        let complete = Arc::new(AtomicBool::new(false));
        let done = complete.clone();
        let handle = std::thread::Builder::new()
            .name("eaglebatch-writer".into())
            .spawn(move || {
                let mut state = WriterThread::new(cfg, dest, next_part, next_part > 0);
                state.run(rx, &done)
            })
            .map_err(|e| Error::internal(format!("cannot start writer thread: {e}")))?;
        Ok(Writer {
            tx: Some(tx),
            handle: Some(handle),
            complete,
        })
    }

    /// Hands a row to the writer (blocks when its queue is full). If the writer thread failed,
    /// returns its error.
    pub fn send(&mut self, row: OutputRow) -> Result<()> {
        let tx = self
            .tx
            .as_ref()
            .ok_or_else(|| Error::internal("writer already finished"))?;
        if tx.send(row).is_err() {
            // The thread exited early, which only happens on an error: report it.
            return Err(match self.join() {
                Err(e) => e,
                Ok(_) => Error::internal("writer thread exited early"),
            });
        }
        Ok(())
    }

    /// A complete run: flushes the remaining rows (an empty part if the directory would hold
    /// no part at all), waits for the thread and returns what was written.
    pub fn finish(&mut self) -> Result<WriterSummary> {
        self.complete.store(true, Ordering::SeqCst);
        self.join()
    }

    /// A failed or interrupted run: flushes the remaining rows into a last part (none if
    /// there are none), waits for the thread and returns what was written.
    pub fn abort(&mut self) -> Result<WriterSummary> {
        self.join()
    }

    fn join(&mut self) -> Result<WriterSummary> {
        self.tx = None;
        let handle = self
            .handle
            .take()
            .ok_or_else(|| Error::internal("writer already finished"))?;
        handle
            .join()
            .map_err(|_| Error::internal("writer thread panicked"))?
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // Like `abort`: flush what was finished; errors here have nowhere to go.
        if self.handle.is_some() {
            let _ = self.join();
        }
    }
}

struct WriterThread {
    cfg: WriterConfig,
    dest: Destination,
    schema: SchemaRef,
    props: WriterProperties,
    next_part: u64,
    /// The directory already held part files when the writer started (a resumed job).
    had_parts: bool,
    buffer: Vec<OutputRow>,
    summary: WriterSummary,
}

impl WriterThread {
    fn new(cfg: WriterConfig, dest: Destination, next_part: u64, had_parts: bool) -> Self {
        let schema = output_schema(&cfg);
        let kv: Vec<KeyValue> = cfg
            .file_metadata
            .iter()
            .map(|(k, v)| KeyValue::new(k.clone(), v.clone()))
            .collect();
        let props = WriterProperties::builder()
            .set_compression(Compression::ZSTD(
                ZstdLevel::try_new(3).expect("valid level"),
            ))
            .set_key_value_metadata(if kv.is_empty() { None } else { Some(kv) })
            .build();
        WriterThread {
            buffer: Vec::with_capacity(cfg.part_rows.min(65_536)),
            cfg,
            dest,
            schema,
            props,
            next_part,
            had_parts,
            summary: WriterSummary::default(),
        }
    }

    /// Writes rows until the channel closes; then the last part, or an empty part when the
    /// run is `complete` and the directory would hold none.
    /// The row with its text decoded (`OutputRow::text_ids`); a failed decode makes it an
    /// error row.
    fn decoded(&mut self, mut row: OutputRow) -> Result<OutputRow> {
        if row.text_ids.is_none() && row.reasoning_ids.is_none() {
            return Ok(row);
        }
        let start = Instant::now();
        let decoder = self.cfg.decoder.as_ref().ok_or_else(|| {
            Error::internal("a row with text_ids reached a writer without a decoder")
        })?;
        let skip = row.skip_special_tokens;
        let decode = |ids: Option<Vec<u32>>| ids.map(|ids| decoder.decode(&ids, skip)).transpose();
        let texts =
            decode(row.text_ids.take()).and_then(|t| Ok((t, decode(row.reasoning_ids.take())?)));
        match texts {
            Ok((text, reasoning)) => {
                row.output_text = text.unwrap_or(std::mem::take(&mut row.output_text));
                row.reasoning_text = reasoning;
            }
            Err(e) => {
                self.summary.decode_errors += 1;
                row = OutputRow {
                    output_text: String::new(),
                    finish_reason: FinishReason::Error,
                    output_tokens: 0,
                    queue_s: None,
                    ttft_s: None,
                    latency_s: None,
                    tpot_s: None,
                    error: Some(format!("decode failed: {e}")),
                    stop_reason: None,
                    output_token_ids: Vec::new(),
                    logprobs: None,
                    ..row
                };
            }
        }
        self.summary.busy += start.elapsed();
        Ok(row)
    }

    fn run(&mut self, rx: Receiver<OutputRow>, complete: &AtomicBool) -> Result<WriterSummary> {
        // When the oldest buffered row must be on disk (None: buffer empty or no interval).
        let mut deadline: Option<Instant> = None;
        loop {
            let row = match deadline {
                Some(d) => match rx.recv_deadline(d) {
                    Ok(row) => row,
                    Err(RecvTimeoutError::Timeout) => {
                        self.flush()?;
                        deadline = None;
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => break,
                },
                None => match rx.recv() {
                    Ok(row) => row,
                    Err(_) => break,
                },
            };
            if self.buffer.is_empty() {
                deadline = self.cfg.flush_interval.map(|iv| Instant::now() + iv);
            }
            let row = self.decoded(row)?;
            self.buffer.push(row);
            if self.buffer.len() >= self.cfg.part_rows {
                self.flush()?;
                deadline = None;
            }
        }
        let no_part = self.summary.part_files.is_empty() && !self.had_parts;
        if !self.buffer.is_empty() || (no_part && complete.load(Ordering::SeqCst)) {
            self.flush()?;
        }
        Ok(std::mem::take(&mut self.summary))
    }

    /// Writes the buffered rows (possibly none) as the next part file, timed.
    fn flush(&mut self) -> Result<()> {
        let start = Instant::now();
        let written = self.write_part();
        self.summary.busy += start.elapsed();
        written
    }

    fn write_part(&mut self) -> Result<()> {
        let rows = std::mem::take(&mut self.buffer);
        let batch = build_batch(&self.schema, &rows, &self.cfg)?;
        let name = format!("part-{:05}.parquet", self.next_part);
        self.next_part += 1;
        let written = match &self.dest {
            Destination::Remote(dir) => dir.put_part(&name, self.encode(&batch)?)?,
            Destination::Local => self.write_local(&name, &batch)?,
        };
        self.summary.rows_written += rows.len() as u64;
        self.summary.part_files.push(written);
        Ok(())
    }

    /// `batch` as the bytes of a complete Parquet file (a remote part: one PUT).
    fn encode(&self, batch: &RecordBatch) -> Result<Vec<u8>> {
        let mut data = Vec::new();
        let mut w = ArrowWriter::try_new(&mut data, self.schema.clone(), Some(self.props.clone()))?;
        w.write(batch)?;
        w.close()?;
        Ok(data)
    }

    /// Writes `batch` as `name` in the output directory: a hidden temporary file, fsynced and
    /// renamed, and the directory fsynced. Returns the part's path.
    fn write_local(&self, name: &str, batch: &RecordBatch) -> Result<PathBuf> {
        let dir = &self.cfg.output_dir;
        let tmp = dir.join(format!(".{name}.tmp"));
        let dst = dir.join(name);
        if let Err(e) = self.write_tmp(&tmp, batch) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        if let Err(e) = std::fs::rename(&tmp, &dst) {
            let _ = std::fs::remove_file(&tmp);
            return Err(Error::io("cannot rename to", &dst, e));
        }
        // Make the rename durable. Not every filesystem allows fsync on a directory.
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(dst)
    }

    /// Writes `batch` as a complete Parquet file at `tmp` and fsyncs it.
    fn write_tmp(&self, tmp: &Path, batch: &RecordBatch) -> Result<()> {
        let file = File::create(tmp).map_err(|e| Error::io("cannot create", tmp, e))?;
        let mut w = ArrowWriter::try_new(file, self.schema.clone(), Some(self.props.clone()))?;
        w.write(batch)?;
        let file = w.into_inner()?;
        file.sync_all()
            .map_err(|e| Error::io("cannot fsync", tmp, e))
    }
}

/// The record batch of `rows` in `schema`'s column order (see `output_schema`): one column
/// per `OutputRow` field, row order kept; `output_token_ids` and `logprobs` only when
/// configured.
fn build_batch(schema: &SchemaRef, rows: &[OutputRow], cfg: &WriterConfig) -> Result<RecordBatch> {
    let text_bytes = rows.iter().map(|r| r.output_text.len()).sum();
    let mut columns: Vec<ArrayRef> = vec![
        id_column(schema, rows)?,
        Arc::new(Int64Array::from_iter_values(
            rows.iter().map(|r| r.row_index),
        )),
        int32_column(rows, |r| Some(r.sample_index)),
        string_column(rows, text_bytes, |r| Some(&r.output_text)),
        string_column(rows, rows.len() * 6, |r| Some(r.finish_reason.as_str())),
        int32_column(rows, |r| Some(r.prompt_tokens)),
        int32_column(rows, |r| Some(r.output_tokens)),
        int32_column(rows, |r| Some(r.cached_tokens)),
        float64_column(rows, |r| r.queue_s),
        float64_column(rows, |r| r.ttft_s),
        float64_column(rows, |r| r.latency_s),
        float64_column(rows, |r| r.tpot_s),
        string_column(rows, 0, |r| r.error.as_deref()),
        int32_column(rows, |r| r.spec_steps),
        int32_column(rows, |r| r.accepted_tokens),
        float64_column(rows, |r| r.accept_length),
        string_column(rows, 0, |r| match &r.stop_reason {
            Some(StopReason::Text(s)) => Some(s.as_str()),
            _ => None,
        }),
        int32_column(rows, |r| match r.stop_reason {
            Some(StopReason::Token(t)) => i32::try_from(t).ok(),
            _ => None,
        }),
    ];
    columns.extend(optional_columns(rows, cfg));
    for (k, (_, dt)) in cfg.kept.iter().enumerate() {
        columns.push(kept_column(dt, rows, k)?);
    }
    Ok(RecordBatch::try_new(schema.clone(), columns)?)
}

/// The columns the settings add (output_schema's order), kept columns aside.
fn optional_columns(rows: &[OutputRow], cfg: &WriterConfig) -> Vec<ArrayRef> {
    let mut columns = Vec::new();
    if cfg.include_token_ids {
        columns.push(token_ids_column(rows));
    }
    if cfg.logprobs {
        columns.push(crate::logprobs::column(
            rows.iter().map(|r| r.logprobs.as_deref()),
        ));
    }
    if cfg.prompt_logprobs {
        columns.push(crate::logprobs::column(
            rows.iter().map(|r| r.prompt_logprobs.as_deref()),
        ));
    }
    if cfg.structured {
        columns.push(string_column(rows, rows.len() * 10, |r| {
            r.structured
                .map(|done| if done { "complete" } else { "incomplete" })
        }));
    }
    if cfg.reasoning {
        columns.push(string_column(rows, 0, |r| r.reasoning_text.as_deref()));
    }
    if cfg.endpoint {
        columns.push(string_column(rows, rows.len() * 20, |r| r.endpoint));
        columns.push(int32_column(rows, |r| Some(r.num_samples)));
    }
    if let Some(shape) = cfg.score {
        columns.extend(crate::score::columns(
            shape,
            rows.iter().map(|r| r.score.as_ref()),
        ));
    }
    if let Some(head) = &cfg.pooled {
        columns.extend(head.columns(rows.iter().map(|r| match &r.score {
            Some(RowScore::Pooled(p)) => Some(p),
            _ => None,
        })));
    }
    columns
}

/// Kept column `k` of the rows: their length-1 arrays concatenated (an empty array of the
/// column's type when there are no rows).
fn kept_column(dt: &DataType, rows: &[OutputRow], k: usize) -> Result<ArrayRef> {
    if rows.is_empty() {
        return Ok(arrow_array::new_empty_array(dt));
    }
    let parts: Vec<&dyn arrow_array::Array> = rows.iter().map(|r| r.kept[k].as_ref()).collect();
    Ok(arrow_select::concat::concat(&parts)?)
}

/// The rows' ids concatenated (each `OutputRow::id` is a one-element array of the id type);
/// an empty array of the schema's id type when there are no rows.
fn id_column(schema: &SchemaRef, rows: &[OutputRow]) -> Result<ArrayRef> {
    if rows.is_empty() {
        return Ok(arrow_array::new_empty_array(schema.field(0).data_type()));
    }
    let parts: Vec<&dyn arrow_array::Array> = rows.iter().map(|r| r.id.as_ref()).collect();
    Ok(arrow_select::concat::concat(&parts)?)
}

/// A string column of `f(row)` (`None` is null); `bytes` is a capacity hint only.
fn string_column<'a>(
    rows: &'a [OutputRow],
    bytes: usize,
    f: impl Fn(&'a OutputRow) -> Option<&'a str>,
) -> ArrayRef {
    let mut b = StringBuilder::with_capacity(rows.len(), bytes);
    for r in rows {
        b.append_option(f(r));
    }
    Arc::new(b.finish())
}

/// An int32 column of `f(row)` (`None` is null).
fn int32_column(rows: &[OutputRow], f: impl Fn(&OutputRow) -> Option<i32>) -> ArrayRef {
    let mut b = Int32Builder::with_capacity(rows.len());
    for r in rows {
        b.append_option(f(r));
    }
    Arc::new(b.finish())
}

/// A float64 column of `f(row)` (`None` is null).
fn float64_column(rows: &[OutputRow], f: impl Fn(&OutputRow) -> Option<f64>) -> ArrayRef {
    let mut b = Float64Builder::with_capacity(rows.len());
    for r in rows {
        b.append_option(f(r));
    }
    Arc::new(b.finish())
}

/// The `output_token_ids` column: one non-null `list<int32>` per row (items nullable, as in
/// `output_schema`).
fn token_ids_column(rows: &[OutputRow]) -> ArrayRef {
    let item = Arc::new(Field::new("item", DataType::Int32, true));
    let mut b = ListBuilder::new(Int32Builder::new()).with_field(item);
    for r in rows {
        let ids: Vec<i32> = r.output_token_ids.iter().map(|&t| t as i32).collect();
        b.values().append_slice(&ids);
        b.append(true);
    }
    Arc::new(b.finish())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{read_parts, TempDir};
    use arrow_array::cast::AsArray;
    use arrow_array::types::{Float64Type, Int32Type, Int64Type};
    use arrow_array::{Array, StringArray};
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    use parquet::file::reader::{FileReader, SerializedFileReader};

    fn row(i: i64, id: &str, reason: FinishReason) -> OutputRow {
        let err = reason == FinishReason::Error;
        OutputRow {
            id: Arc::new(StringArray::from(vec![id])),
            row_index: i,
            sample_index: 0,
            num_samples: 1,
            output_text: if err {
                String::new()
            } else {
                format!("text {i}")
            },
            finish_reason: reason,
            prompt_tokens: if err { 0 } else { 3 },
            output_tokens: if err { 0 } else { 2 },
            cached_tokens: 0,
            queue_s: (!err).then_some(0.5),
            ttft_s: (!err).then_some(0.25),
            latency_s: (!err).then_some(1.0),
            tpot_s: (!err).then_some(0.75),
            error: err.then(|| "bad row".to_string()),
            spec_steps: None,
            accepted_tokens: None,
            accept_length: None,
            output_token_ids: if err { vec![] } else { vec![7, 2] },
            logprobs: None,
            prompt_logprobs: None,
            text_ids: None,
            reasoning_ids: None,
            reasoning_text: None,
            structured: None,
            skip_special_tokens: true,
            endpoint: None,
            score: None,
            stop_reason: None,
            kept: Vec::new(),
        }
    }

    fn cfg(dir: &Path, part_rows: usize) -> WriterConfig {
        WriterConfig {
            output_dir: dir.to_path_buf(),
            storage: Default::default(),
            part_rows,
            file_metadata: BTreeMap::from([(
                "eaglebatch.job".to_string(),
                "{\"a\": 1}".to_string(),
            )]),
            include_token_ids: true,
            logprobs: false,
            prompt_logprobs: false,
            structured: false,
            reasoning: false,
            endpoint: false,
            score: None,
            pooled: None,
            id_type: DataType::Utf8,
            kept: Vec::new(),
            flush_interval: None,
            decoder: None,
        }
    }

    #[test]
    fn rows_with_text_ids_are_decoded_by_the_writer_thread() {
        let tok = Arc::new(crate::testutil::byte_level_tokenizer());
        let text = "héllo wörld, 42";
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        let dir = TempDir::new("writer-decode");
        let mut c = cfg(dir.path(), 10);
        c.decoder = Some(tok);
        let mut w = Writer::start(c).unwrap();
        let mut r = row(0, "a", FinishReason::Length);
        (r.output_text, r.text_ids) = (String::new(), Some(ids));
        w.send(r).unwrap();
        w.send(row(1, "b", FinishReason::Length)).unwrap(); // already has its text
        assert_eq!(w.finish().unwrap().decode_errors, 0);
        let batches = read_parts(dir.path());
        let texts = batches[0]
            .column_by_name("output_text")
            .unwrap()
            .as_string::<i32>();
        assert_eq!((texts.value(0), texts.value(1)), (text, "text 1"));
    }

    #[test]
    fn round_trip_parts_schema_and_metadata() {
        let dir = TempDir::new("writer-rt");
        let mut w = Writer::start(cfg(dir.path(), 2)).unwrap();
        for i in 0..5 {
            let reason = if i == 3 {
                FinishReason::Error
            } else {
                FinishReason::Length
            };
            w.send(row(i, &format!("id{i}"), reason)).unwrap();
        }
        let summary = w.finish().unwrap();
        assert_eq!(summary.rows_written, 5);
        assert_eq!(summary.part_files.len(), 3);
        assert!(summary.part_files[0].ends_with("part-00000.parquet"));

        let batches = read_parts(dir.path());
        let total: usize = batches.iter().map(|b| b.num_rows()).sum();
        assert_eq!(total, 5);
        let b = &batches[1];
        let names: Vec<&str> = b
            .schema_ref()
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .collect();
        assert_eq!(
            names,
            [
                "id",
                "row_index",
                "sample_index",
                "output_text",
                "finish_reason",
                "prompt_tokens",
                "output_tokens",
                "cached_tokens",
                "queue_s",
                "ttft_s",
                "latency_s",
                "tpot_s",
                "error",
                "spec_steps",
                "accepted_tokens",
                "accept_length",
                "stop_reason",
                "stop_token_id",
                "output_token_ids"
            ]
        );
        assert_eq!(b.column(0).as_string::<i32>().value(1), "id3");
        assert_eq!(b.column(1).as_primitive::<Int64Type>().value(1), 3);
        assert_eq!(b.column(4).as_string::<i32>().value(1), "error");
        assert_eq!(b.column(12).as_string::<i32>().value(1), "bad row");
        assert!(b.column(9).is_null(1));
        assert_eq!(b.column(3).as_string::<i32>().value(0), "text 2");
        assert_eq!(b.column(11).as_primitive::<Float64Type>().value(0), 0.75);
        assert!(b.column(13).is_null(0));
        let ids = b.column(18).as_list::<i32>().value(0);
        assert_eq!(ids.as_primitive::<Int32Type>().values(), &[7, 2]);

        let reader =
            SerializedFileReader::new(File::open(&summary.part_files[0]).unwrap()).unwrap();
        let kv = reader
            .metadata()
            .file_metadata()
            .key_value_metadata()
            .unwrap();
        assert!(kv
            .iter()
            .any(|k| k.key == "eaglebatch.job" && k.value.as_deref() == Some("{\"a\": 1}")));
        let codec = reader.metadata().row_group(0).column(0).compression();
        assert!(matches!(codec, Compression::ZSTD(_)), "{codec:?}");
    }

    #[test]
    fn numbering_continues_after_existing_parts() {
        let dir = TempDir::new("writer-num");
        let mut w = Writer::start(cfg(dir.path(), 10)).unwrap();
        w.send(row(0, "a", FinishReason::Stop)).unwrap();
        w.finish().unwrap();
        std::fs::rename(
            dir.path().join("part-00000.parquet"),
            dir.path().join("part-00007.parquet"),
        )
        .unwrap();
        let mut w = Writer::start(cfg(dir.path(), 10)).unwrap();
        w.send(row(1, "b", FinishReason::Stop)).unwrap();
        let s = w.finish().unwrap();
        assert!(s.part_files[0].ends_with("part-00008.parquet"));
        assert_eq!(
            read_parts(dir.path())
                .iter()
                .map(|b| b.num_rows())
                .sum::<usize>(),
            2
        );
    }

    #[test]
    fn flush_interval_closes_a_part_before_it_is_full() {
        let dir = TempDir::new("writer-interval");
        let mut c = cfg(dir.path(), 1000);
        c.flush_interval = Some(Duration::from_millis(50));
        let mut w = Writer::start(c).unwrap();
        w.send(row(0, "a", FinishReason::Stop)).unwrap();
        let t0 = Instant::now();
        while !dir.path().join("part-00000.parquet").exists() {
            assert!(t0.elapsed() < Duration::from_secs(10), "part not flushed");
            std::thread::sleep(Duration::from_millis(5));
        }
        w.send(row(1, "b", FinishReason::Stop)).unwrap();
        let s = w.finish().unwrap();
        assert_eq!(s.part_files.len(), 2);
        assert_eq!(s.rows_written, 2);
    }

    #[test]
    fn no_empty_part_when_earlier_parts_exist() {
        let dir = TempDir::new("writer-resume");
        let mut w = Writer::start(cfg(dir.path(), 10)).unwrap();
        w.send(row(0, "a", FinishReason::Stop)).unwrap();
        w.finish().unwrap();
        // A resumed run with nothing left to do adds no file.
        let mut w = Writer::start(cfg(dir.path(), 10)).unwrap();
        let s = w.finish().unwrap();
        assert!(s.part_files.is_empty());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn abort_and_drop_close_the_sent_rows_and_write_no_empty_part() {
        let dir = TempDir::new("writer-abort");
        let mut w = Writer::start(cfg(dir.path(), 10)).unwrap();
        w.send(row(0, "a", FinishReason::Stop)).unwrap();
        w.send(row(1, "b", FinishReason::Error)).unwrap();
        let s = w.abort().unwrap();
        assert_eq!((s.rows_written, s.part_files.len()), (2, 1));
        assert_eq!(read_parts(dir.path())[0].num_rows(), 2);
        assert!(w.finish().is_err(), "closed once");
        // Nothing sent: no part at all (a failed run has no "complete" empty result).
        let empty = TempDir::new("writer-abort-empty");
        let mut w = Writer::start(cfg(empty.path(), 10)).unwrap();
        let s = w.abort().unwrap();
        assert!(s.part_files.is_empty());
        drop(Writer::start(cfg(empty.path(), 10)).unwrap());
        assert_eq!(std::fs::read_dir(empty.path()).unwrap().count(), 0);
        // A drop without finish or abort writes the rows sent, like abort.
        let mut w = Writer::start(cfg(empty.path(), 10)).unwrap();
        w.send(row(2, "c", FinishReason::Stop)).unwrap();
        drop(w);
        let names: Vec<_> = std::fs::read_dir(empty.path()).unwrap().collect();
        assert_eq!(names.len(), 1);
        assert_eq!(read_parts(empty.path())[0].num_rows(), 1);
    }

    /// `OUTPUT_COLUMNS` is exactly the schema's own columns with every optional one on, so the
    /// names kept input columns may not take cannot drift from what is written.
    #[test]
    fn output_columns_list_every_column_the_schema_may_have() {
        let dir = TempDir::new("writer-names");
        let mut c = cfg(dir.path(), 1);
        (c.logprobs, c.prompt_logprobs, c.endpoint) = (true, true, true);
        (c.structured, c.reasoning) = (true, true);
        c.score = Some(crate::score::ScoreShape::Pair);
        let schema = output_schema(&c);
        let mut names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        let mut want = OUTPUT_COLUMNS.to_vec();
        names.sort_unstable();
        want.sort_unstable();
        assert_eq!(names, want);
    }

    #[test]
    fn no_rows_still_writes_a_readable_empty_part() {
        let dir = TempDir::new("writer-empty");
        let mut w = Writer::start(cfg(dir.path(), 10)).unwrap();
        let s = w.finish().unwrap();
        assert_eq!(s.part_files.len(), 1);
        assert_eq!(s.rows_written, 0);
        let b = ParquetRecordBatchReaderBuilder::try_new(File::open(&s.part_files[0]).unwrap())
            .unwrap();
        assert_eq!(b.schema().fields().len(), 19);
    }
}
