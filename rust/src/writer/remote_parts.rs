//! Part files on an object store (`output_dir` an `s3://`, `gs://` or `az://` URL).
//!
//! Invariants (the commit protocol of docs/scale-out.md "Object storage"):
//! - a part is one PUT of the whole file under its final name, so it is visible whole or not
//!   at all (no rename, no temporary object);
//! - the PUT is create-only (unless the job opted out, `storage.unsafe_no_conditional_writes`):
//!   a part name that exists already is never overwritten; the writer stops instead, since
//!   another run is writing the same directory. Part numbers run on from the highest one
//!   listed at start, so a second writer of one directory collides with the first on the next
//!   number rather than duplicating rows under other names.

use std::path::PathBuf;

use bytes::Bytes;
use object_store::path::Path as Key;

use crate::error::{Error, Result};
use crate::storage::{Put, StorageSettings, Store, StoreError};

pub(super) struct RemoteDir {
    store: Store,
    prefix: Key,
    create_only: bool,
}

impl RemoteDir {
    pub(super) fn open(url: &str, settings: &StorageSettings) -> Result<RemoteDir> {
        let (store, prefix) = Store::open(url, settings)?;
        Ok(RemoteDir {
            store,
            prefix,
            create_only: !settings.unconditional,
        })
    }

    /// Highest N among the `part-N.parquet` objects directly under the directory.
    pub(super) fn highest_part_number(&self) -> Result<Option<u64>> {
        let listed = self.store.list(&self.prefix)?;
        let numbers = listed.iter().filter_map(|e| {
            let rest = e.key.strip_prefix(self.prefix.as_ref())?;
            let name = rest.trim_start_matches('/');
            super::part_number(name)
        });
        Ok(numbers.max())
    }

    /// Uploads a finished part as `name`; returns its URL.
    pub(super) fn put_part(&self, name: &str, data: Vec<u8>) -> Result<PathBuf> {
        let key = self.prefix.clone().join(name);
        let how = if self.create_only {
            Put::Create
        } else {
            Put::Overwrite
        };
        match self.store.put(&key, Bytes::from(data), how) {
            Ok(_) => Ok(PathBuf::from(self.store.url(&key))),
            Err(StoreError::Exists(_)) => Err(Error::Storage(format!(
                "{}: another run wrote this part while this one ran (two runs over one output \
                 directory, or this run's lease was taken over); this run stops without \
                 overwriting it: run the job again to resume",
                self.store.url(&key)
            ))),
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_continue_and_a_taken_name_stops_the_writer() {
        let dir = RemoteDir {
            store: Store::memory(),
            prefix: Key::from("out/shard-00000-of-00002"),
            create_only: true,
        };
        assert_eq!(dir.highest_part_number().unwrap(), None);
        dir.put_part("part-00000.parquet", b"a".to_vec()).unwrap();
        dir.put_part("part-00007.parquet", b"b".to_vec()).unwrap();
        dir.put_part(".part-00009.parquet.tmp", b"c".to_vec())
            .unwrap();
        assert_eq!(dir.highest_part_number().unwrap(), Some(7));
        let e = dir
            .put_part("part-00007.parquet", b"d".to_vec())
            .unwrap_err();
        assert!(e.to_string().contains("another run wrote this part"), "{e}");
        let (kept, _) = dir
            .store
            .get(&Key::from("out/shard-00000-of-00002/part-00007.parquet"))
            .unwrap();
        assert_eq!(&kept[..], b"b"); // never overwritten
    }
}
