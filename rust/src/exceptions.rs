//! The Python exceptions of `eaglebatch._native`, and the one place where `Error` becomes one
//! (`UserInput` -> `UserInputError`, everything else -> `NativeError`). Shared by both wings'
//! bindings: `python` (the scheduler's) and `cpu::bindings` (the kernels').

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::PyErr;

use crate::error::Error;

create_exception!(
    eaglebatch._native,
    NativeError,
    PyException,
    "Any error raised by the Rust side (bad input file, missing column, tokenizer, I/O)."
);
create_exception!(
    eaglebatch._native,
    UserInputError,
    NativeError,
    "An error the user can fix (missing file / column, wrong column type): message names it."
);

create_exception!(
    eaglebatch._native,
    StorageConflict,
    NativeError,
    "A compare-and-swap on an object store lost: another writer changed the object first."
);

pub(crate) fn to_py(e: Error) -> PyErr {
    match e {
        Error::UserInput(msg) => UserInputError::new_err(msg),
        other => NativeError::new_err(other.to_string()),
    }
}
