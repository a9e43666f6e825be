//! Object storage: `s3://`, `gs://` and `az://` (also `abfs://`, `abfss://`) URLs wherever a
//! job names an input file or an output directory. The one layer through which eaglebatch
//! touches an object store, the reader's ranged reads (`remote_file`), the writer's parts and
//! the Python side's listings, footers, deletions and leases (its bindings) alike: the
//! `object_store` crate, because it writes create-only (`PutMode::Create`: S3 `If-None-Match:
//! *`, GCS `ifGenerationMatch=0`, Azure `If-None-Match: *`) and compare-and-swap
//! (`PutMode::Update`) on all three, which the commit protocol needs (docs/scale-out.md).
//!
//! Invariants:
//! - a path is remote exactly when it starts with one of `SCHEMES`; everything else is local;
//! - credentials come from each cloud's standard environment variables (as the crate's
//!   `from_env` builders read them) and `StorageSettings::options`; no message this module
//!   builds carries a credential (`redact`);
//! - transient failures (5xx, throttling, timeouts, dropped connections) are retried with
//!   backoff by the crate (`RETRY`); what reaches the caller is permanent or out of retries.

pub mod remote_file;

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use object_store::path::Path as Key;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, UpdateVersion};

use crate::error::{Error, Result};

pub use remote_file::{RemoteFile, Source};

/// URL prefixes of the stores eaglebatch reads and writes.
pub const SCHEMES: [&str; 5] = ["s3://", "gs://", "az://", "abfs://", "abfss://"];

/// The job's `storage` section, as the Rust side needs it (one value for the whole run).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct StorageSettings {
    /// An S3-compatible (or emulator) endpoint, e.g. `http://127.0.0.1:9000`.
    pub endpoint: Option<String>,
    /// The crate's configuration keys (`aws_region`, `google_service_account`, ...).
    pub options: BTreeMap<String, String>,
    /// `storage.unsafe_no_conditional_writes`: parts are plain PUTs (the store ignores or
    /// lacks create-only writes; the job gave up the exactly-once guarantee).
    pub unconditional: bool,
}

/// The remote URL `path` spells, if it is one.
pub fn remote_url(path: &Path) -> Option<&str> {
    let s = path.to_str()?;
    SCHEMES.iter().any(|p| s.starts_with(p)).then_some(s)
}

/// An object's listing entry.
#[derive(Debug, Clone)]
pub struct Entry {
    pub key: String,
    pub size: u64,
    pub e_tag: Option<String>,
    pub version: Option<String>,
}

/// How a put may land.
#[derive(Debug, Clone)]
pub enum Put {
    Overwrite,
    /// Only if no object has the name (fails with `StoreError::Exists`).
    Create,
    /// Only if the object is still this version (fails with `StoreError::Conflict`).
    Replace {
        e_tag: Option<String>,
        version: Option<String>,
    },
}

/// A failed request, classified; its message names the URL and carries no credential.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Exists(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Denied(String),
    #[error("{0}")]
    Unsupported(String),
    #[error("{0}")]
    Other(String),
}

impl From<StoreError> for Error {
    fn from(e: StoreError) -> Self {
        Error::Storage(e.to_string())
    }
}

/// One bucket (container) of one store, with the settings it was opened with.
#[derive(Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    /// `scheme://bucket` (no trailing slash).
    base: String,
    secrets: Arc<Vec<String>>,
}

/// The crate's retry policy: exponential backoff from 100 ms, up to 10 retries within 3
/// minutes (its defaults, stated here because the exactly-once tests rely on them).
fn retry() -> object_store::RetryConfig {
    object_store::RetryConfig {
        max_retries: 10,
        retry_timeout: Duration::from_secs(180),
        ..Default::default()
    }
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("eaglebatch-storage")
            .enable_all()
            .build()
            .expect("cannot start the object-store runtime")
    })
}

/// Runs a request to completion on the store runtime (callers are plain threads).
fn block_on<F: Future>(f: F) -> F::Output {
    runtime().block_on(f)
}

impl Store {
    /// The store holding `url` and the key of `url` in it. Stores are shared per bucket and
    /// settings (one HTTP client each).
    pub fn open(url: &str, settings: &StorageSettings) -> Result<(Store, Key)> {
        static OPEN: OnceLock<Mutex<HashMap<(String, StorageSettings), Store>>> = OnceLock::new();
        let parsed = url::Url::parse(url)
            .map_err(|e| Error::user(format!("{url}: not a valid object-store URL ({e})")))?;
        let bucket = parsed.host_str().unwrap_or_default();
        if bucket.is_empty() {
            return Err(Error::user(format!("{url}: the URL names no bucket")));
        }
        let base = format!("{}://{bucket}", parsed.scheme());
        let key = Key::parse(parsed.path().trim_start_matches('/'))
            .map_err(|e| Error::user(format!("{url}: not a valid object name ({e})")))?;
        let cache = OPEN.get_or_init(Default::default);
        let id = (base.clone(), settings.clone());
        if let Some(store) = cache.lock().unwrap().get(&id) {
            return Ok((store.clone(), key));
        }
        let store = Store {
            inner: build(&parsed, settings)?,
            base,
            secrets: Arc::new(secrets(settings)),
        };
        cache.lock().unwrap().insert(id, store.clone());
        Ok((store, key))
    }

    /// `scheme://bucket/key`.
    pub fn url(&self, key: &Key) -> String {
        format!("{}/{key}", self.base)
    }

    /// Every object under `prefix` (a folder: `prefix/...`), recursively.
    pub fn list(&self, prefix: &Key) -> std::result::Result<Vec<Entry>, StoreError> {
        use futures_util::TryStreamExt;
        let listing = block_on(self.inner.list(Some(prefix)).try_collect::<Vec<_>>());
        let metas = listing.map_err(|e| self.error(prefix, e))?;
        Ok(metas.into_iter().map(entry).collect())
    }

    pub fn head(&self, key: &Key) -> std::result::Result<Entry, StoreError> {
        block_on(self.inner.head(key))
            .map(entry)
            .map_err(|e| self.error(key, e))
    }

    pub fn get_range(
        &self,
        key: &Key,
        range: Range<u64>,
    ) -> std::result::Result<Bytes, StoreError> {
        block_on(self.inner.get_range(key, range)).map_err(|e| self.error(key, e))
    }

    /// The whole object and its entry (for compare-and-swap).
    pub fn get(&self, key: &Key) -> std::result::Result<(Bytes, Entry), StoreError> {
        block_on(async {
            let got = self.inner.get(key).await?;
            let meta = entry(got.meta.clone());
            Ok((got.bytes().await?, meta))
        })
        .map_err(|e| self.error(key, e))
    }

    /// Writes `data` as one object (one request: it is visible whole or not at all).
    /// Returns the new version's entry (size, e_tag, version).
    pub fn put(&self, key: &Key, data: Bytes, how: Put) -> std::result::Result<Entry, StoreError> {
        let size = data.len() as u64;
        let mode = match how {
            Put::Overwrite => PutMode::Overwrite,
            Put::Create => PutMode::Create,
            Put::Replace { e_tag, version } => PutMode::Update(UpdateVersion { e_tag, version }),
        };
        let opts = PutOptions {
            mode,
            ..Default::default()
        };
        let put = block_on(self.inner.put_opts(key, PutPayload::from_bytes(data), opts));
        let done = put.map_err(|e| self.error(key, e))?;
        Ok(Entry {
            key: key.to_string(),
            size,
            e_tag: done.e_tag,
            version: done.version,
        })
    }

    pub fn delete(&self, key: &Key) -> std::result::Result<(), StoreError> {
        block_on(self.inner.delete(key)).map_err(|e| self.error(key, e))
    }

    /// The crate's error as ours: classified, naming the URL, credentials removed.
    fn error(&self, key: &Key, e: object_store::Error) -> StoreError {
        use object_store::Error as E;
        let url = self.url(key);
        let text = redact(&brief(&e.to_string()), &self.secrets);
        let msg = |what: &str| format!("{url}: {what} ({text})");
        match e {
            E::NotFound { .. } => StoreError::NotFound(msg("not found")),
            E::AlreadyExists { .. } => StoreError::Exists(msg("already exists")),
            E::Precondition { .. } | E::NotModified { .. } => {
                StoreError::Conflict(msg("changed by another writer"))
            }
            E::PermissionDenied { .. } | E::Unauthenticated { .. } => {
                StoreError::Denied(msg("access denied: check the credentials and the bucket"))
            }
            E::NotImplemented { .. } | E::NotSupported { .. } => {
                StoreError::Unsupported(msg("not supported by this store"))
            }
            _ => StoreError::Other(msg("request failed")),
        }
    }
}

fn entry(m: object_store::ObjectMeta) -> Entry {
    Entry {
        key: m.location.to_string(),
        size: m.size,
        e_tag: m.e_tag,
        version: m.version,
    }
}

/// The crate's store for `url`'s bucket: the cloud's environment first (`from_env`), then the
/// job's endpoint and options (an unknown option is a user error naming it).
fn build(url: &url::Url, s: &StorageSettings) -> Result<Arc<dyn ObjectStore>> {
    use object_store::{aws, azure, gcp};
    let bad = |k: &str| Error::user(format!("storage.options: unknown key {k:?} for {url}"));
    let http = s
        .endpoint
        .as_deref()
        .is_some_and(|e| e.starts_with("http://"));
    let mut opts: Vec<(String, String)> = s.options.clone().into_iter().collect();
    if http {
        opts.push(("allow_http".into(), "true".into()));
    }
    let built = match url.scheme() {
        "s3" => {
            let mut b = aws::AmazonS3Builder::from_env().with_url(url.as_str());
            if let Some(e) = &s.endpoint {
                b = b.with_endpoint(e);
            }
            for (k, v) in opts {
                b = b.with_config(k.parse().map_err(|_| bad(&k))?, v);
            }
            b.with_retry(retry()).build().map(|s| Arc::new(s) as _)
        }
        "gs" => {
            let mut b = gcp::GoogleCloudStorageBuilder::from_env().with_url(url.as_str());
            if let Some(e) = &s.endpoint {
                b = b.with_config(gcp::GoogleConfigKey::BaseUrl, e);
            }
            for (k, v) in opts {
                b = b.with_config(k.parse().map_err(|_| bad(&k))?, v);
            }
            b.with_retry(retry()).build().map(|s| Arc::new(s) as _)
        }
        _ => {
            let mut b = azure::MicrosoftAzureBuilder::from_env().with_url(url.as_str());
            if let Some(e) = &s.endpoint {
                b = b.with_config(azure::AzureConfigKey::Endpoint, e);
            }
            for (k, v) in opts {
                b = b.with_config(k.parse().map_err(|_| bad(&k))?, v);
            }
            b.with_retry(retry()).build().map(|s| Arc::new(s) as _)
        }
    };
    built.map_err(|e| {
        let why = redact(&e.to_string(), &secrets(s));
        Error::user(format!("{url}: cannot use this store ({why})"))
    })
}

/// Values that must never appear in a message: the credentials in the endpoint's URL
/// (`http://KEY:SECRET@host`), the job's options and the clouds' credential variables (names
/// `is_secret_name` accepts). The endpoint's come first: the whole user
/// information before its parts.
fn secrets(s: &StorageSettings) -> Vec<String> {
    let mut found = s
        .endpoint
        .as_deref()
        .map(endpoint_secrets)
        .unwrap_or_default();
    found.extend(named_secrets(s));
    found
}

/// The user information of an endpoint URL as written and as the `url` crate prints it
/// (percent-encoded), whole and its user name and password alone.
fn endpoint_secrets(endpoint: &str) -> Vec<String> {
    let mut out = Vec::new();
    if let Some((_, rest)) = endpoint.split_once("://") {
        let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
        if let Some((userinfo, _)) = authority.rsplit_once('@') {
            out.push(userinfo.to_string());
        }
    }
    if let Ok(u) = url::Url::parse(endpoint) {
        let (user, pass) = (u.username().to_string(), u.password().unwrap_or_default());
        if !user.is_empty() && !pass.is_empty() {
            out.push(format!("{user}:{pass}"));
        }
        out.extend([user, pass.to_string()]);
    }
    out.retain(|v| !v.is_empty());
    out
}

/// The words that, in any case, make a name a credential's.
const SECRET_WORDS: [&str; 6] = ["KEY", "SECRET", "TOKEN", "PASSWORD", "SAS", "CREDENTIAL"];

/// Whether an option's or variable's name names a credential (it holds one of SECRET_WORDS,
/// in any case). The one rule: messages here redact such values, and the Python side
/// (job/secrets.py, through the extension) refuses them on the command line by it.
pub fn is_secret_name(name: &str) -> bool {
    let name = name.to_ascii_uppercase();
    SECRET_WORDS.iter().any(|w| name.contains(w))
}

/// The values of the job's credential options and of the clouds' credential variables.
fn named_secrets(s: &StorageSettings) -> Vec<String> {
    let env = std::env::vars().filter(|(k, _)| {
        ["AWS_", "AZURE_", "GOOGLE_"]
            .iter()
            .any(|p| k.starts_with(p))
            && is_secret_name(k)
    });
    let opts = s
        .options
        .clone()
        .into_iter()
        .filter(|(k, _)| is_secret_name(k));
    env.chain(opts)
        .map(|(_, v)| v)
        .filter(|v| v.len() >= 4)
        .collect()
}

/// The crate's message without the response body it quotes, but the body's error code:
/// "... 403 Forbidden [AccessDenied]".
fn brief(text: &str) -> String {
    let (head, body) = text.split_once("<?xml").unwrap_or((text, ""));
    let head = head.trim_end().trim_end_matches(':');
    let code = body
        .split_once("<Code>")
        .and_then(|(_, rest)| rest.split_once("</Code>"))
        .map(|(code, _)| format!(" [{code}]"));
    format!("{head}{}", code.unwrap_or_default())
}

/// `text` with every secret replaced by `***`.
fn redact(text: &str, secrets: &[String]) -> String {
    secrets
        .iter()
        .fold(text.to_string(), |t, s| t.replace(s.as_str(), "***"))
}

impl Store {
    /// An in-memory store (the crate's), for tests of what is built on `Store`.
    #[cfg(test)]
    pub(crate) fn memory() -> Store {
        Store {
            inner: Arc::new(object_store::memory::InMemory::new()),
            base: "memory://test".into(),
            secrets: Arc::new(Vec::new()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_only_and_compare_and_swap() {
        let s = Store::memory();
        let k = Key::from("d/x");
        let first = s.put(&k, Bytes::from_static(b"1"), Put::Create).unwrap();
        let again = s.put(&k, Bytes::from_static(b"2"), Put::Create);
        assert!(matches!(again, Err(StoreError::Exists(_))), "{again:?}");
        let stale = Put::Replace {
            e_tag: Some("\"nope\"".into()),
            version: None,
        };
        assert!(matches!(
            s.put(&k, Bytes::from_static(b"3"), stale),
            Err(StoreError::Conflict(_))
        ));
        let current = Put::Replace {
            e_tag: first.e_tag,
            version: first.version,
        };
        s.put(&k, Bytes::from_static(b"4"), current).unwrap();
        assert_eq!(&s.get(&k).unwrap().0[..], b"4");
        assert_eq!(s.list(&Key::from("d")).unwrap().len(), 1);
        assert!(matches!(
            s.head(&Key::from("d/y")),
            Err(StoreError::NotFound(_))
        ));
    }

    #[test]
    fn remote_urls_are_recognised_by_scheme() {
        assert_eq!(remote_url(Path::new("s3://b/x")), Some("s3://b/x"));
        assert_eq!(remote_url(Path::new("gs://b/x/")), Some("gs://b/x/"));
        assert_eq!(remote_url(Path::new("az://c/x")), Some("az://c/x"));
        assert_eq!(remote_url(Path::new("/data/s3://x")), None);
        assert_eq!(remote_url(Path::new("s3:/b")), None);
    }

    #[test]
    fn secrets_are_redacted() {
        let s = StorageSettings {
            endpoint: None,
            options: [("aws_secret_access_key".to_string(), "hunter22".to_string())].into(),
            ..Default::default()
        };
        let found = secrets(&s);
        assert!(found.contains(&"hunter22".to_string()));
        assert_eq!(redact("key=hunter22 x", &found), "key=*** x");
    }

    #[test]
    fn only_credential_options_are_redacted() {
        for k in [
            "aws_secret_access_key",
            "token",
            "PASSWORD",
            "azure_storage_sas_key",
        ] {
            assert!(is_secret_name(k), "{k}");
        }
        for k in ["endpoint", "region", "aws_region", "bucket"] {
            assert!(!is_secret_name(k), "{k}");
        }
        let s = StorageSettings {
            options: [
                ("aws_session_token".to_string(), "tok-12345".to_string()),
                ("aws_region".to_string(), "eu-west-9".to_string()),
            ]
            .into(),
            ..Default::default()
        };
        let found = named_secrets(&s);
        assert!(found.contains(&"tok-12345".to_string()));
        assert!(!found.contains(&"eu-west-9".to_string()));
    }

    #[test]
    fn endpoint_credentials_are_redacted() {
        let s = StorageSettings {
            endpoint: Some("http://AKIDKEY:se%2Fcret99@127.0.0.1:9000/".into()),
            ..Default::default()
        };
        let found = secrets(&s);
        let msg = "HEAD http://AKIDKEY:se%2Fcret99@127.0.0.1:9000/b/x failed";
        assert_eq!(
            redact(msg, &found),
            "HEAD http://***@127.0.0.1:9000/b/x failed"
        );
        assert_eq!(redact("user AKIDKEY", &found), "user ***");
        let plain = StorageSettings {
            endpoint: Some("http://127.0.0.1:9000".into()),
            ..Default::default()
        };
        assert!(endpoint_secrets(plain.endpoint.as_deref().unwrap()).is_empty());
    }

    #[test]
    fn urls_need_a_bucket_and_known_options() {
        let s = StorageSettings::default();
        assert!(Store::open("s3:///x", &s).is_err());
        let bad = StorageSettings {
            endpoint: None,
            options: [("no_such_key".to_string(), "1".to_string())].into(),
            ..Default::default()
        };
        let e = Store::open("s3://bucket-x/y", &bad)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("no_such_key"), "{e}");
    }
}
