//! `eaglebatch._native.ObjectStore`: the Python side's access to object stores through the
//! same layer as the reader and writer (storage.rs): listings, footers and whole parts, the
//! lease object and deletions. Every method takes a full URL and releases the GIL while it
//! waits on the network.
//!
//! Errors: not found -> FileNotFoundError, create-only name taken -> FileExistsError, a
//! compare-and-swap that lost -> StorageConflict, 403/401 -> PermissionError, an operation the
//! store lacks -> NotImplementedError, anything else (after the retries) -> OSError. Messages
//! name the URL and no credential.

use std::collections::BTreeMap;

use bytes::Bytes;
use pyo3::exceptions::{
    PyFileExistsError, PyFileNotFoundError, PyNotImplementedError, PyOSError, PyPermissionError,
};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::exceptions::{to_py, StorageConflict};
use crate::storage::{Entry, Put, RemoteFile, StorageSettings, Store, StoreError};

/// (url, size, e_tag, version)
type PyEntry = (String, u64, Option<String>, Option<String>);

#[pyclass(name = "ObjectStore", module = "eaglebatch._native", frozen)]
pub(super) struct PyObjectStore {
    settings: StorageSettings,
}

fn py_err(e: StoreError) -> PyErr {
    let msg = e.to_string();
    match e {
        StoreError::NotFound(_) => PyFileNotFoundError::new_err(msg),
        StoreError::Exists(_) => PyFileExistsError::new_err(msg),
        StoreError::Conflict(_) => StorageConflict::new_err(msg),
        StoreError::Denied(_) => PyPermissionError::new_err(msg),
        StoreError::Unsupported(_) => PyNotImplementedError::new_err(msg),
        StoreError::Other(_) => PyOSError::new_err(msg),
    }
}

impl PyObjectStore {
    fn open(&self, url: &str) -> PyResult<(Store, object_store::path::Path)> {
        Store::open(url, &self.settings).map_err(to_py)
    }
}

fn py_entry(store: &Store, e: Entry) -> PyEntry {
    let url = store.url(&object_store::path::Path::from(e.key.as_str()));
    (url, e.size, e.e_tag, e.version)
}

#[pymethods]
impl PyObjectStore {
    #[new]
    #[pyo3(signature = (endpoint=None, options=BTreeMap::new(), unconditional=false))]
    fn new(
        endpoint: Option<String>,
        options: BTreeMap<String, String>,
        unconditional: bool,
    ) -> Self {
        PyObjectStore {
            settings: StorageSettings {
                endpoint,
                options,
                unconditional,
            },
        }
    }

    /// Every object under the folder `url` (recursively), sorted by URL.
    fn list(&self, py: Python<'_>, url: &str) -> PyResult<Vec<PyEntry>> {
        let (store, key) = self.open(url)?;
        let listed = py.detach(|| store.list(&key)).map_err(py_err)?;
        let mut out: Vec<PyEntry> = listed.into_iter().map(|e| py_entry(&store, e)).collect();
        out.sort();
        Ok(out)
    }

    fn head(&self, py: Python<'_>, url: &str) -> PyResult<PyEntry> {
        let (store, key) = self.open(url)?;
        let e = py.detach(|| store.head(&key)).map_err(py_err)?;
        Ok(py_entry(&store, e))
    }

    /// The whole object: (bytes, e_tag, version).
    fn get<'py>(
        &self,
        py: Python<'py>,
        url: &str,
    ) -> PyResult<(Bound<'py, PyBytes>, Option<String>, Option<String>)> {
        let (store, key) = self.open(url)?;
        let (data, e) = py.detach(|| store.get(&key)).map_err(py_err)?;
        Ok((PyBytes::new(py, &data), e.e_tag, e.version))
    }

    /// Bytes `[start, end)` (clipped to the object's end).
    fn get_range<'py>(
        &self,
        py: Python<'py>,
        url: &str,
        start: u64,
        end: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let (store, key) = self.open(url)?;
        let data = py
            .detach(|| store.get_range(&key, start..end))
            .map_err(py_err)?;
        Ok(PyBytes::new(py, &data))
    }

    /// One PUT of `data`. `mode`: "overwrite", "create" (FileExistsError if the name is
    /// taken) or "replace" (StorageConflict unless the object is still `e_tag` / `version`).
    /// Returns the new (e_tag, version).
    #[pyo3(signature = (url, data, mode, e_tag=None, version=None))]
    fn put(
        &self,
        py: Python<'_>,
        url: &str,
        data: Vec<u8>,
        mode: &str,
        e_tag: Option<String>,
        version: Option<String>,
    ) -> PyResult<(Option<String>, Option<String>)> {
        let how = match mode {
            "overwrite" => Put::Overwrite,
            "create" => Put::Create,
            "replace" => Put::Replace { e_tag, version },
            other => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "mode {other:?}"
                )))
            }
        };
        let (store, key) = self.open(url)?;
        let e = py
            .detach(|| store.put(&key, Bytes::from(data), how))
            .map_err(py_err)?;
        Ok((e.e_tag, e.version))
    }

    fn delete(&self, py: Python<'_>, url: &str) -> PyResult<()> {
        let (store, key) = self.open(url)?;
        py.detach(|| store.delete(&key)).map_err(py_err)
    }

    /// `url`'s size (one HEAD) and a reader of its ranges through the reader's block cache.
    fn open_file(&self, py: Python<'_>, url: &str) -> PyResult<PyRemoteFile> {
        let settings = self.settings.clone();
        let file = py
            .detach(|| RemoteFile::open(url, &settings))
            .map_err(to_py)?;
        Ok(PyRemoteFile(file))
    }
}

/// A remote object opened for ranged reads (`read_at`), as pyarrow's file-like wrapper
/// (py/eaglebatch/storage/remote_file.py) needs it.
#[pyclass(name = "RemoteFile", module = "eaglebatch._native", frozen)]
pub(super) struct PyRemoteFile(RemoteFile);

#[pymethods]
impl PyRemoteFile {
    fn size(&self) -> u64 {
        parquet::file::reader::Length::len(&self.0)
    }

    fn read_at<'py>(
        &self,
        py: Python<'py>,
        start: u64,
        length: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let data = py
            .detach(|| self.0.read_at(start, length))
            .map_err(py_err)?;
        Ok(PyBytes::new(py, &data))
    }
}
