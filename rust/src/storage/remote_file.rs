//! A remote Parquet file as the parquet crate's `ChunkReader`: ranged GETs through a small
//! cache of aligned blocks, so memory stays bounded whatever the file's size.
//!
//! Invariants:
//! - at most `CACHED_BLOCKS` blocks of `BLOCK` bytes are held per open file; a read longer
//!   than the cache is fetched directly and not kept;
//! - the object is read at the size it had when opened (`head`); a part of it that changes
//!   meanwhile is the caller's problem, as for a local file;
//! - missing contiguous blocks of one read are fetched in one request, with `READ_AHEAD`
//!   more when the read continues the previous block (a column chunk, a JSONL file).

use std::collections::VecDeque;
use std::fs::File;
use std::io::Read;
use std::path::Path;
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use object_store::path::Path as Key;
use parquet::errors::ParquetError;
use parquet::file::reader::{ChunkReader, Length};

use super::{remote_url, StorageSettings, Store, StoreError};
use crate::error::{Error, Result};

/// Bytes per cached block (a ranged GET fetches whole blocks).
pub const BLOCK: u64 = 1 << 20;
/// Blocks kept per open file (16 MiB).
pub const CACHED_BLOCKS: usize = 16;
/// Blocks fetched past a miss that continues the block read before it (sequential reads:
/// fewer, larger requests).
pub const READ_AHEAD: u64 = 7;

struct Inner {
    store: Store,
    key: Key,
    size: u64,
    /// (block number, its bytes), most recently used last.
    blocks: Mutex<VecDeque<(u64, Bytes)>>,
}

/// An object opened for ranged reads. Cheap to clone (clones share the cache).
#[derive(Clone)]
pub struct RemoteFile(Arc<Inner>);

impl RemoteFile {
    pub fn open(url: &str, settings: &StorageSettings) -> Result<RemoteFile> {
        let (store, key) = Store::open(url, settings)?;
        let size = store.head(&key)?.size;
        Ok(RemoteFile::new(store, key, size))
    }

    /// The object `key` of `store`, `size` bytes long.
    pub fn new(store: Store, key: Key, size: u64) -> RemoteFile {
        RemoteFile(Arc::new(Inner {
            store,
            key,
            size,
            blocks: Mutex::new(VecDeque::new()),
        }))
    }

    pub fn url(&self) -> String {
        self.0.store.url(&self.0.key)
    }

    /// `len` bytes from `start` (clipped to the file's end).
    pub fn read_at(&self, start: u64, len: usize) -> std::result::Result<Bytes, StoreError> {
        let end = (start + len as u64).min(self.0.size);
        if start >= end {
            return Ok(Bytes::new());
        }
        if end - start > BLOCK * (CACHED_BLOCKS as u64 / 2) {
            return self.0.store.get_range(&self.0.key, start..end);
        }
        let (first, last) = (start / BLOCK, (end - 1) / BLOCK);
        self.fetch_missing(first, last)?;
        let blocks = self.0.blocks.lock().unwrap();
        let mut out = BytesMut::with_capacity((end - start) as usize);
        for b in first..=last {
            let (_, data) = blocks.iter().find(|(n, _)| *n == b).expect("block fetched");
            let lo = start.saturating_sub(b * BLOCK) as usize;
            let hi = ((end - b * BLOCK) as usize).min(data.len());
            out.extend_from_slice(&data[lo..hi]);
        }
        Ok(out.freeze())
    }

    /// Makes blocks `first..=last` resident, fetching the missing run in one request.
    fn fetch_missing(&self, first: u64, last: u64) -> std::result::Result<(), StoreError> {
        let missing: Vec<u64> = {
            let mut blocks = self.0.blocks.lock().unwrap();
            for b in first..=last {
                if let Some(i) = blocks.iter().position(|(n, _)| *n == b) {
                    let hit = blocks.remove(i).unwrap();
                    blocks.push_back(hit);
                }
            }
            (first..=last)
                .filter(|b| !blocks.iter().any(|(n, _)| n == b))
                .collect()
        };
        let (Some(&lo), Some(&hi)) = (missing.first(), missing.last()) else {
            return Ok(());
        };
        let sequential = lo > 0
            && self
                .0
                .blocks
                .lock()
                .unwrap()
                .iter()
                .any(|(n, _)| *n == lo - 1);
        let last_block = self.0.size.div_ceil(BLOCK).saturating_sub(1);
        let hi = if sequential {
            (hi + READ_AHEAD).min(last_block)
        } else {
            hi
        };
        let end = ((hi + 1) * BLOCK).min(self.0.size);
        let data = self.0.store.get_range(&self.0.key, lo * BLOCK..end)?;
        let mut blocks = self.0.blocks.lock().unwrap();
        for b in lo..=hi {
            let from = ((b - lo) * BLOCK) as usize;
            let to = (from + BLOCK as usize).min(data.len());
            blocks.retain(|(n, _)| *n != b);
            blocks.push_back((b, data.slice(from..to)));
        }
        while blocks.len() > CACHED_BLOCKS {
            blocks.pop_front();
        }
        Ok(())
    }
}

fn parquet_error(e: StoreError) -> ParquetError {
    ParquetError::External(Box::new(e))
}

impl Length for RemoteFile {
    fn len(&self) -> u64 {
        self.0.size
    }
}

/// Sequential reads from a position, a block at a time.
pub struct RemoteRead {
    file: RemoteFile,
    pos: u64,
}

impl Read for RemoteRead {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let in_block = (BLOCK - self.pos % BLOCK) as usize;
        let got = self
            .file
            .read_at(self.pos, buf.len().min(in_block))
            .map_err(std::io::Error::other)?;
        buf[..got.len()].copy_from_slice(&got);
        self.pos += got.len() as u64;
        Ok(got.len())
    }
}

impl ChunkReader for RemoteFile {
    type T = RemoteRead;

    fn get_read(&self, start: u64) -> parquet::errors::Result<RemoteRead> {
        Ok(RemoteRead {
            file: self.clone(),
            pos: start,
        })
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        let got = self.read_at(start, length).map_err(parquet_error)?;
        if got.len() < length {
            return Err(ParquetError::EOF(format!(
                "{}: wanted {length} bytes at {start}, the object has {}",
                self.url(),
                self.0.size
            )));
        }
        Ok(got)
    }
}

/// An input file, local or remote, for the Parquet reader.
pub enum Source {
    Local(File),
    Remote(RemoteFile),
}

impl Source {
    /// Opens `path` (a local path or a URL of `SCHEMES`).
    pub fn open(path: &Path, settings: &StorageSettings) -> Result<Source> {
        match remote_url(path) {
            Some(url) => Ok(Source::Remote(RemoteFile::open(url, settings)?)),
            None => File::open(path)
                .map(Source::Local)
                .map_err(|e| Error::io("cannot open input", path, e)),
        }
    }

    /// A second handle on the same file (the remote one shares its cache).
    pub fn try_clone(&self) -> Result<Source> {
        match self {
            Source::Local(f) => f
                .try_clone()
                .map(Source::Local)
                .map_err(|e| Error::internal(format!("cannot reopen an input file: {e}"))),
            Source::Remote(r) => Ok(Source::Remote(r.clone())),
        }
    }

    /// Its bytes from the start, streamed (the OpenAI Batch JSONL reader).
    pub fn into_read(self) -> Box<dyn Read + Send> {
        match self {
            Source::Local(f) => Box::new(f),
            Source::Remote(r) => Box::new(RemoteRead { file: r, pos: 0 }),
        }
    }
}

impl Length for Source {
    fn len(&self) -> u64 {
        match self {
            Source::Local(f) => f.len(),
            Source::Remote(r) => r.len(),
        }
    }
}

impl ChunkReader for Source {
    type T = Box<dyn Read + Send>;

    fn get_read(&self, start: u64) -> parquet::errors::Result<Self::T> {
        Ok(match self {
            Source::Local(f) => Box::new(f.get_read(start)?),
            Source::Remote(r) => Box::new(r.get_read(start)?),
        })
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        match self {
            Source::Local(f) => f.get_bytes(start, length),
            Source::Remote(r) => r.get_bytes(start, length),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::Put;

    fn file(len: usize) -> (RemoteFile, Vec<u8>) {
        let store = Store::memory();
        let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        let key = Key::from("f.bin");
        store
            .put(&key, Bytes::from(data.clone()), Put::Create)
            .unwrap();
        (RemoteFile::new(store, key, len as u64), data)
    }

    #[test]
    fn reads_equal_the_bytes_across_blocks_and_the_cache_stays_bounded() {
        let len = (BLOCK as usize) * 40 + 12_345;
        let (f, data) = file(len);
        let b = BLOCK as usize;
        for (start, n) in [
            (0, 10),
            (b - 3, 7),
            (3 * b + 5, 2 * b),
            (len - 5, 100),
            (len, 1),
        ] {
            let got = f.read_at(start as u64, n).unwrap();
            let end = (start + n).min(len);
            assert_eq!(&got[..], &data[start..end], "{start} {n}");
        }
        let mut r = f.get_read(0).unwrap();
        let mut all = Vec::new();
        r.read_to_end(&mut all).unwrap();
        assert_eq!(all, data);
        assert!(f.0.blocks.lock().unwrap().len() <= CACHED_BLOCKS);
        let big = f.get_bytes(0, len).unwrap(); // longer than the cache: fetched directly
        assert_eq!(&big[..], &data[..]);
        assert!(f.get_bytes(len as u64 - 2, 5).is_err()); // past the end
    }
}
