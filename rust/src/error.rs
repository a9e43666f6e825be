//! The crate's single error type.
//!
//! Invariant: `UserInput` is reserved for problems the user can fix (missing file, missing
//! column, wrong column type, bad option value) and its message names the offending file /
//! column / option. Everything else is a `NativeError` on the Python side (see
//! `exceptions.rs`, the only place errors are converted to Python exceptions).

use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Something the user can fix; the message names the file, column or option.
    #[error("{0}")]
    UserInput(String),
    /// An I/O failure, with what we were doing (and on which path) when it happened.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// An object-store request that failed for good (storage.rs): the message names the URL.
    #[error("{0}")]
    Storage(String),
    #[error("parquet error: {0}")]
    Parquet(String),
    #[error("arrow error: {0}")]
    Arrow(String),
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    #[error("chat template error: {0}")]
    Template(String),
    /// A broken invariant or API misuse (e.g. commit without a plan); never a user's fault.
    #[error("internal error: {0}")]
    Internal(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn user(msg: impl Into<String>) -> Self {
        Error::UserInput(msg.into())
    }

    pub fn internal(msg: impl Into<String>) -> Self {
        Error::Internal(msg.into())
    }

    /// An I/O error annotated with the action and the path it concerned.
    pub fn io(action: &str, path: &Path, source: std::io::Error) -> Self {
        Error::Io {
            context: format!("{action} {}", path.display()),
            source,
        }
    }

    /// Adds a prefix (typically the file name) to the message, keeping the variant.
    pub fn context(self, prefix: &str) -> Self {
        match self {
            Error::UserInput(m) => Error::UserInput(format!("{prefix}: {m}")),
            Error::Io { context, source } => Error::Io {
                context: format!("{prefix}: {context}"),
                source,
            },
            Error::Tokenizer(m) => Error::Tokenizer(format!("{prefix}: {m}")),
            Error::Template(m) => Error::Template(format!("{prefix}: {m}")),
            Error::Internal(m) => Error::Internal(format!("{prefix}: {m}")),
            Error::Parquet(m) => Error::Parquet(format!("{prefix}: {m}")),
            Error::Arrow(m) => Error::Arrow(format!("{prefix}: {m}")),
            Error::Storage(m) => Error::Storage(format!("{prefix}: {m}")),
        }
    }
}

impl From<parquet::errors::ParquetError> for Error {
    fn from(e: parquet::errors::ParquetError) -> Self {
        Error::Parquet(e.to_string())
    }
}

impl From<arrow_schema::ArrowError> for Error {
    fn from(e: arrow_schema::ArrowError) -> Self {
        Error::Arrow(e.to_string())
    }
}
