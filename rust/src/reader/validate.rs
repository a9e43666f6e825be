//! Input validation, up front: every input file exists and is readable, its columns have
//! types the reader can read (the sampling columns' rule is `columns::check_column_type`), and
//! the row counts come from the Parquet footers (or a survey of an OpenAI Batch file's
//! requests). The result, `InputSpec`, is what the reader thread reads. The one copy of these
//! rules: `validate` and `run` call it through the extension (`check_inputs`) before any model
//! loads, and the scheduler again as it opens the files. Messages name the job key, the
//! column and the file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use super::columns::{check_column_keys, check_column_type};
use crate::column_kind::{dense_type, is_int, is_list_of, is_text, type_name, FileTypes};
use crate::config::RunConfig;
use crate::error::{Error, Result};
use crate::storage::{remote_url, Source, StorageSettings};

/// One validated input file.
#[derive(Debug, Clone)]
pub struct InputFile {
    pub path: PathBuf,
    pub num_rows: u64,
}

/// The validated input: files in order, the column names and the id type.
#[derive(Debug, Clone)]
pub struct InputSpec {
    pub files: Vec<InputFile>,
    pub prompt_column: Option<String>,
    pub messages_column: Option<String>,
    pub id_column: Option<String>,
    /// Sampling key -> input column of per-row values (read by `columns`).
    pub sampling_columns: BTreeMap<String, String>,
    /// `task: score`: the continuation (string) or choices (list<string>) column.
    pub score_column: Option<String>,
    /// OpenAI Batch JSONL input (each line names its endpoint), else Parquet.
    pub openai_batch: bool,
    /// Arrow type of the output `id` column (the input id column's type, or Int64).
    pub id_type: DataType,
    /// Kept input columns (`RunConfig::keep_columns`) and their output types: a
    /// dictionary's values type, unified across files as the id column's is.
    pub kept: Vec<(String, DataType)>,
    /// The input's rows: the footers' row counts summed, capped by `limit`.
    pub total_rows: u64,
    /// The rows this run generates, `[row_start, row_end)` (`row_range` clipped to
    /// `total_rows`; the whole input without one).
    pub row_start: u64,
    pub row_end: u64,
    /// How remote input files are reached (storage.rs).
    pub storage: StorageSettings,
    /// OpenAI Batch input: what its lines ask (default for Parquet).
    pub batch_lines: crate::openai_batch::Survey,
}

impl InputSpec {
    /// How many rows this run is to generate (before resume).
    pub fn range_rows(&self) -> u64 {
        self.row_end - self.row_start
    }
}

/// Checks that every input path names an existing file, before any is opened. Input
/// discovery (directories, globs, pyarrow's skipping of '.*' / '_*' names) is one rule on the
/// Python side (`inputs.py`), which passes the resolved files; a directory here is a user
/// error, so no second rule can drift from it.
fn check_input_paths(paths: &[PathBuf], storage: &StorageSettings) -> Result<()> {
    for path in paths {
        if remote_url(path).is_some() {
            Source::open(path, storage)?; // exists and is readable (one HEAD request)
            continue;
        }
        let meta = std::fs::metadata(path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                Error::user(format!("input file not found: {}", path.display()))
            } else {
                Error::io("cannot access input", path, e)
            }
        })?;
        if meta.is_dir() {
            return Err(Error::user(format!(
                "input {} is a directory; pass its files (the Python side resolves directories)",
                path.display()
            )));
        }
    }
    Ok(())
}

/// Whether `dt` is a `list<struct<role: string, content: string>>` type (its strings of any
/// spelling, dictionaries included: column_kind.rs).
fn messages_struct_ok(dt: &DataType) -> bool {
    let struct_ok = |item: &DataType| {
        let DataType::Struct(fields) = item else {
            return false;
        };
        ["role", "content"].iter().all(|name| {
            fields
                .iter()
                .any(|f| f.name() == name && is_text(f.data_type()))
        })
    };
    is_list_of(dt, struct_ok)
}

/// An integer or string column, or a dictionary of one.
fn id_type_ok(dt: &DataType) -> bool {
    is_int(dt) || is_text(dt)
}

/// The one field named `name`, which job key `key` reads: a column missing, or appearing more
/// than once (which one the job means is unknowable, so none is picked), is a user error
/// naming the key and the file.
fn find_column<'a>(schema: &'a Schema, path: &Path, key: &str, name: &str) -> Result<&'a Field> {
    let count = schema.fields().iter().filter(|f| f.name() == name).count();
    if count > 1 {
        let times = if count == 2 {
            "twice".to_string()
        } else {
            format!("{count} times")
        };
        return Err(Error::user(format!(
            "{key}: column '{name}' appears {times} in {}; rename all but one (the job cannot \
             tell which one it means)",
            path.display()
        )));
    }
    schema.field_with_name(name).map_err(|_| {
        let available: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        Error::user(format!(
            "{key}: column '{name}' not found in {} (columns: {})",
            path.display(),
            available.join(", ")
        ))
    })
}

/// A user error: column `name` (read by job key `key`) of file `path` has type `dt`, not the
/// `expected` one.
fn mistyped(key: &str, name: &str, path: &Path, dt: &DataType, expected: &str) -> Error {
    Error::user(format!(
        "{key}: column '{name}' in {} has type {}, expected {expected}",
        path.display(),
        type_name(dt)
    ))
}

/// Compression codecs this build can decode.
/// (Every codec pyarrow writes.)
fn codec_supported(c: parquet::basic::Compression) -> bool {
    use parquet::basic::Compression as C;
    matches!(
        c,
        C::UNCOMPRESSED | C::SNAPPY | C::GZIP(_) | C::LZ4 | C::LZ4_RAW | C::ZSTD(_) | C::BROTLI(_)
    )
}

/// Fails early (naming file and column) if a column we read uses an unsupported codec.
fn check_codecs(
    builder: &ParquetRecordBatchReaderBuilder<Source>,
    path: &Path,
    cfg: &RunConfig,
) -> Result<()> {
    let wanted: Vec<&str> = [
        &cfg.input.prompt_column,
        &cfg.input.messages_column,
        &cfg.input.id_column,
    ]
    .into_iter()
    .chain([&cfg.input.continuation_column, &cfg.input.choices_column])
    .flatten()
    .chain(cfg.input.sampling_columns.values())
    .chain(&cfg.output.keep_columns)
    .map(String::as_str)
    .collect();
    for rg in builder.metadata().row_groups() {
        for col in rg.columns() {
            let root = col.column_path().parts().first().map(String::as_str);
            if root.is_some_and(|r| wanted.contains(&r)) && !codec_supported(col.compression()) {
                return Err(Error::user(format!(
                    "input.path: column '{}' of {} is compressed with {}, which eaglebatch \
                     cannot read (supported: uncompressed, snappy, gzip, lz4, lz4_raw, zstd, \
                     brotli); rewrite the file",
                    root.unwrap_or_default(),
                    path.display(),
                    col.compression()
                )));
            }
        }
    }
    Ok(())
}

/// Checks every input file (exists, is Parquet, has usable columns) and counts rows from the
/// footers. Errors are `UserInput` and name the file and column. Files are checked in order
/// and the first failure is the error; every file's id column must have the first one's type.
pub fn validate_inputs(cfg: &RunConfig) -> Result<InputSpec> {
    check_input_paths(&cfg.input.input_files, &cfg.storage)?;
    check_column_keys(cfg.input.sampling_columns.keys()).map_err(Error::user)?;
    if cfg.openai_batch() {
        return validate_batch_files(cfg);
    }
    let mut files = Vec::with_capacity(cfg.input.input_files.len());
    let mut types = FileTypes::default();
    let mut total: u64 = 0;
    for path in &cfg.input.input_files {
        let builder = open_parquet(path, &cfg.storage)?;
        check_file_columns(builder.schema(), path, cfg, &mut types)?;
        check_codecs(&builder, path, cfg)?;
        let num_rows = builder.metadata().file_metadata().num_rows().max(0) as u64;
        total += num_rows;
        files.push(InputFile {
            path: path.clone(),
            num_rows,
        });
    }
    let total_rows = cfg.input.limit.map_or(total, |limit| total.min(limit));
    let (start, end) = cfg.input.row_range.unwrap_or((0, total_rows));
    let row_end = end.min(total_rows);
    Ok(InputSpec {
        files,
        prompt_column: cfg.input.prompt_column.clone(),
        messages_column: cfg.input.messages_column.clone(),
        id_column: cfg.input.id_column.clone(),
        sampling_columns: cfg.input.sampling_columns.clone(),
        score_column: score_column(cfg).cloned(),
        openai_batch: false,
        id_type: cfg
            .input
            .id_column
            .as_ref()
            .and_then(|c| types.output_type(c))
            .unwrap_or(DataType::Int64),
        kept: (cfg.output.keep_columns.iter())
            .filter_map(|c| Some((c.clone(), types.output_type(c)?)))
            .collect(),
        total_rows,
        row_start: start.min(row_end),
        row_end,
        storage: cfg.storage.clone(),
        batch_lines: Default::default(),
    })
}

/// The columns one file holds for the job: each it reads present once and of a type its key
/// takes; the id and kept columns' types recorded in `types` (one kind across files).
fn check_file_columns(
    schema: &Schema,
    path: &Path,
    cfg: &RunConfig,
    types: &mut FileTypes,
) -> Result<()> {
    check_text_columns(schema, path, cfg)?;
    check_sampling_columns(schema, path, &cfg.input.sampling_columns)?;
    if let Some(col) = &cfg.input.id_column {
        let dt = check_id_column(schema, path, col)?;
        types.add("input.id_column", col, &dt, path)?;
    }
    for col in &cfg.output.keep_columns {
        let field = find_column(schema, path, "output.keep_columns", col)?;
        types.add(
            "output.keep_columns",
            col,
            dense_type(field.data_type()),
            path,
        )?;
    }
    Ok(())
}

/// `task: score`'s column of continuations or choices.
fn score_column(cfg: &RunConfig) -> Option<&String> {
    cfg.input
        .continuation_column
        .as_ref()
        .or(cfg.input.choices_column.as_ref())
}

/// OpenAI Batch JSONL files: requests counted by streaming each file (`survey_requests`);
/// ids are custom_ids. Input none of whose lines asks a served endpoint is a user error.
fn validate_batch_files(cfg: &RunConfig) -> Result<InputSpec> {
    let mut files = Vec::with_capacity(cfg.input.input_files.len());
    let mut seen = crate::openai_batch::Survey {
        embed: cfg.pool_head().is_some(),
        ..Default::default()
    };
    for path in &cfg.input.input_files {
        let num_rows = crate::openai_batch::survey_requests(path, &cfg.storage, &mut seen)?;
        files.push(InputFile {
            path: path.clone(),
            num_rows,
        });
    }
    if seen.first.is_none() && seen.requests > 0 {
        let named = match cfg.input.input_files.as_slice() {
            [one] => one.display().to_string(),
            many => format!("the {} input files", many.len()),
        };
        let urls = match seen.embed {
            true => format!("{} (task: embed)", crate::openai_keys::EMBEDDINGS_URL),
            false => format!(
                "{} or {}",
                crate::openai_keys::CHAT_URL,
                crate::openai_keys::COMPLETIONS_URL
            ),
        };
        return Err(Error::user(format!(
            "input.path: no line of {named} is a request to {urls}"
        )));
    }
    let total_rows = cfg
        .input
        .limit
        .map_or(seen.requests, |l| seen.requests.min(l));
    let (start, end) = cfg.input.row_range.unwrap_or((0, total_rows));
    let row_end = end.min(total_rows);
    Ok(InputSpec {
        files,
        prompt_column: None,
        messages_column: None,
        score_column: None,
        id_column: Some("custom_id".to_string()),
        sampling_columns: BTreeMap::new(),
        openai_batch: true,
        id_type: DataType::Utf8,
        kept: Vec::new(),
        total_rows,
        row_start: start.min(row_end),
        row_end,
        storage: cfg.storage.clone(),
        batch_lines: seen,
    })
}

/// Opens a file and reads its Parquet footer; a file that is not Parquet is a user error.
fn open_parquet(
    path: &Path,
    storage: &StorageSettings,
) -> Result<ParquetRecordBatchReaderBuilder<Source>> {
    let file = Source::open(path, storage)?;
    ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| {
        Error::user(format!(
            "input.path: {} is not a readable Parquet file ({e})",
            path.display()
        ))
    })
}

/// (column, the job key that names it, its type check, the type expected).
type TextCheck<'a> = (&'a Option<String>, &'a str, fn(&DataType) -> bool, &'a str);

/// The configured text columns have the types their rows are read as: prompt and
/// continuation a string, choices a list<string>, messages a
/// `list<struct<role: string, content: string>>`.
fn check_text_columns(schema: &Schema, path: &Path, cfg: &RunConfig) -> Result<()> {
    let list_of_text = |dt: &DataType| is_list_of(dt, is_text);
    let checks: [TextCheck<'_>; 4] = [
        (
            &cfg.input.messages_column,
            "input.messages_column",
            messages_struct_ok,
            "a list of {role: string, content: string} structs",
        ),
        (
            &cfg.input.prompt_column,
            "input.prompt_column",
            is_text,
            "a string",
        ),
        (
            &cfg.input.continuation_column,
            "input.continuation_column",
            is_text,
            "a string",
        ),
        (
            &cfg.input.choices_column,
            "input.choices_column",
            list_of_text,
            "list<string>",
        ),
    ];
    for (column, key, ok, expected) in checks {
        let Some(col) = column else { continue };
        let f = find_column(schema, path, key, col)?;
        if !ok(f.data_type()) {
            return Err(mistyped(key, col, path, f.data_type(), expected));
        }
    }
    Ok(())
}

/// Every sampling column exists and has a type its key can read.
fn check_sampling_columns(
    schema: &Schema,
    path: &Path,
    columns: &BTreeMap<String, String>,
) -> Result<()> {
    for (key, col) in columns {
        let name = format!("input.sampling_columns.{key}");
        let f = find_column(schema, path, &name, col)?;
        check_column_type(key, f.data_type())
            .map_err(|expected| mistyped(&name, col, path, f.data_type(), expected))?;
    }
    Ok(())
}

/// The type the ids of column `col` are written as (a dictionary's value type), which must
/// exist and be an integer or string column.
fn check_id_column(schema: &Schema, path: &Path, col: &str) -> Result<DataType> {
    let key = "input.id_column";
    let f = find_column(schema, path, key, col)?;
    let dt = f.data_type();
    if !id_type_ok(dt) {
        return Err(mistyped(key, col, path, dt, "an integer or string"));
    }
    Ok(dense_type(dt).clone())
}

/// The input checks `validate` and `run` make before any model loads (the extension's
/// `check_inputs`): the kept columns resolved (`keep_all`: `output.keep_columns: "*"`, every
/// column of the first input file but an id column named `id`, which is the output's `id`)
/// and named as no column this job writes, then every file (`validate_inputs`).
pub fn check_job_inputs(cfg: &mut RunConfig, keep_all: bool) -> Result<InputSpec> {
    if keep_all && !cfg.openai_batch() {
        let first = cfg.input.input_files.first().cloned().unwrap_or_default();
        let builder = open_parquet(&first, &cfg.storage)?;
        let named_id = |c: &str| c == "id" && cfg.input.id_column.as_deref() == Some("id");
        let mut names: Vec<String> = Vec::new();
        for f in builder.schema().fields() {
            // a name twice is one entry: `validate_inputs` refuses the file naming it
            if !named_id(f.name()) && !names.contains(f.name()) {
                names.push(f.name().clone());
            }
        }
        cfg.output.keep_columns = names;
    }
    cfg.validate_keep_columns().map_err(|e| match e {
        Error::UserInput(m) if keep_all => {
            Error::user(format!("{m} (list the columns to keep instead of \"*\")"))
        }
        e => e,
    })?;
    validate_inputs(cfg)
}
