//! A checkpoint location: an `object_store` backend plus a key prefix, opened from a URL,
//! with retries under a total deadline and cancellation on every call.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use rand::RngExt;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result, StoreErrorKind, redact_userinfo};

/// Tunables for store calls. Defaults suit object stores over a LAN or the internet.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Total time one logical call (all its retries) may take.
    pub deadline_ms: u64,
    /// Attempts per logical call, the first included.
    pub attempts_max: u32,
    /// First retry backoff; doubles per attempt, with jitter.
    pub backoff_initial_ms: u64,
    pub backoff_max_ms: u64,
    /// Objects at least this big go up as multipart uploads (`file://` stores default to
    /// never: a local put is already staged and renamed).
    pub multipart_threshold_bytes: usize,
    /// Part size for multipart uploads (S3 needs >= 5 MiB except the last).
    pub multipart_part_bytes: usize,
    /// The largest manifest a commit writes; never above what readers accept
    /// ([`crate::format::MANIFEST_BYTES_MAX`], which is also the default).
    pub manifest_bytes_max: u64,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            deadline_ms: 300_000,
            attempts_max: 8,
            backoff_initial_ms: 50,
            backoff_max_ms: 5_000,
            multipart_threshold_bytes: 16 * 1024 * 1024,
            multipart_part_bytes: 8 * 1024 * 1024,
            manifest_bytes_max: crate::format::MANIFEST_BYTES_MAX,
        }
    }
}

/// A checkpoint location. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Store {
    pub(crate) inner: Arc<dyn ObjectStore>,
    prefix: ObjPath,
    /// The URL without credentials or query, used in every message.
    display: String,
    /// For `file://`: the root directory, so puts can be fsynced.
    local_root: Option<PathBuf>,
    pub(crate) opts: StoreOptions,
    /// What this store and its clones read.
    reads: Arc<ReadCounter>,
}

#[derive(Debug, Default)]
struct ReadCounter {
    bytes: AtomicU64,
    gets: AtomicU64,
    heads: AtomicU64,
    lists: AtomicU64,
}

/// What a store (and every clone of it) has read so far: object bytes (as stored, before
/// decoding; manifests and part records included) and the reads that fetched them (a GET or
/// ranged GET resuming one that broke off on a remote store, one per object on a local
/// directory), the requests that only asked whether an object exists and how long it is
/// (a HEAD, or a stat of a local file), and the listings of a directory's objects (each one
/// or more requests: a page holds up to 1,000 objects on S3, GCS and Azure).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ReadStats {
    pub bytes: u64,
    pub gets: u64,
    pub heads: u64,
    pub lists: u64,
}

impl std::fmt::Display for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.display)
    }
}

impl Store {
    /// Opens a checkpoint URL: `file:///abs/dir` (or a plain path), `memory://`,
    /// `s3://bucket/prefix`, `az://container/prefix`, `gs://bucket/prefix`. Credentials and
    /// endpoints come from the usual environment variables (`AWS_*` including `AWS_ENDPOINT`
    /// and `AWS_ALLOW_HTTP`, `AZURE_*`, `GOOGLE_*`).
    pub fn open(url: &str) -> Result<Store> {
        Self::open_with_options(url, std::iter::empty::<(String, String)>())
    }

    /// Like [`Store::open`], with extra backend configuration keys applied after the
    /// environment (`aws_endpoint`, `azure_storage_account_name`, ...).
    pub fn open_with_options<I, K, V>(url: &str, options: I) -> Result<Store>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: Into<String>,
    {
        let shown = redact_userinfo(url.split(['?', '#']).next().unwrap_or(""));
        let bad = |reason: String| Error::InvalidUrl {
            url: shown.clone(),
            reason,
        };
        let options: Vec<(String, String)> = options
            .into_iter()
            .map(|(k, v)| (k.as_ref().to_ascii_lowercase(), v.into()))
            .collect();
        let normalized = if url.contains("://") {
            url.to_string()
        } else {
            let abs = std::path::absolute(url).map_err(|e| bad(e.to_string()))?;
            format!("file://{}", abs.display())
        };
        let parsed = url::Url::parse(&normalized).map_err(|e| bad(e.to_string()))?;
        let trimmed = |p: &str| p.trim_matches('/').to_string();
        let (inner, prefix, local_root): (Arc<dyn ObjectStore>, String, Option<PathBuf>) =
            match parsed.scheme() {
                "file" => {
                    let dir = parsed
                        .to_file_path()
                        .map_err(|_| bad("not a local absolute path".into()))?;
                    std::fs::create_dir_all(&dir).map_err(|e| bad(format!("creating it: {e}")))?;
                    let fs = object_store::local::LocalFileSystem::new_with_prefix(&dir)
                        .map_err(|e| bad(e.to_string()))?;
                    // Normal form (no `//`, no `.`), as readers of the paths it names
                    // compare them.
                    (
                        Arc::new(fs),
                        String::new(),
                        Some(dir.components().collect()),
                    )
                }
                "memory" => (
                    Arc::new(object_store::memory::InMemory::new()),
                    trimmed(parsed.path()),
                    None,
                ),
                "s3" | "s3a" => {
                    use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
                    let mut b = AmazonS3Builder::from_env().with_url(normalized.clone());
                    for (k, v) in &options {
                        let key: AmazonS3ConfigKey =
                            k.parse().map_err(|_| bad(format!("unknown option {k}")))?;
                        b = b.with_config(key, v.clone());
                    }
                    let s = b
                        .build()
                        .map_err(|e| bad(crate::error::redact(&e.to_string())))?;
                    (Arc::new(s), trimmed(parsed.path()), None)
                }
                "az" | "azure" | "abfs" | "abfss" => {
                    use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
                    let mut b = MicrosoftAzureBuilder::from_env().with_url(normalized.clone());
                    for (k, v) in &options {
                        let key: AzureConfigKey =
                            k.parse().map_err(|_| bad(format!("unknown option {k}")))?;
                        b = b.with_config(key, v.clone());
                    }
                    let s = b
                        .build()
                        .map_err(|e| bad(crate::error::redact(&e.to_string())))?;
                    (Arc::new(s), trimmed(parsed.path()), None)
                }
                "gs" => {
                    use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
                    let mut b = GoogleCloudStorageBuilder::from_env().with_url(normalized.clone());
                    for (k, v) in &options {
                        let key: GoogleConfigKey =
                            k.parse().map_err(|_| bad(format!("unknown option {k}")))?;
                        b = b.with_config(key, v.clone());
                    }
                    let s = b
                        .build()
                        .map_err(|e| bad(crate::error::redact(&e.to_string())))?;
                    (Arc::new(s), trimmed(parsed.path()), None)
                }
                other => return Err(bad(format!("unsupported scheme {other:?}"))),
            };
        let prefix = ObjPath::parse(&prefix).map_err(|e| bad(e.to_string()))?;
        let mut opts = StoreOptions::default();
        if local_root.is_some() {
            // A local put is already a staged write and a rename; multipart only adds copies.
            opts.multipart_threshold_bytes = usize::MAX;
        }
        Ok(Store {
            inner,
            prefix,
            display: redact_userinfo(normalized.split(['?', '#']).next().unwrap_or("")),
            local_root,
            opts,
            reads: Arc::default(),
        })
    }

    /// What this store and its clones have read so far.
    pub fn read_stats(&self) -> ReadStats {
        ReadStats {
            bytes: self.reads.bytes.load(Ordering::Relaxed),
            gets: self.reads.gets.load(Ordering::Relaxed),
            heads: self.reads.heads.load(Ordering::Relaxed),
            lists: self.reads.lists.load(Ordering::Relaxed),
        }
    }

    /// Counts one read of `bytes` bytes.
    pub(crate) fn count_read(&self, bytes: u64) {
        self.reads.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.reads.gets.fetch_add(1, Ordering::Relaxed);
    }

    /// Replaces the call options.
    pub fn with_options(mut self, opts: StoreOptions) -> Self {
        self.opts = opts;
        self
    }

    /// Whether chunk compression pays by default on this store: on remote object stores the
    /// network is the bottleneck and fewer bytes go faster; on a local file system or in memory
    /// the CPU spent compressing costs more than the bytes it saves (see `BENCHMARKS.md`).
    pub fn compression_pays(&self) -> bool {
        self.is_remote()
    }

    /// Whether the store is a local directory (`file://`).
    pub(crate) fn has_local_root(&self) -> bool {
        self.local_root.is_some()
    }

    /// On `file://`, the store's root directory.
    pub fn local_root(&self) -> Option<&std::path::Path> {
        self.local_root.as_deref()
    }

    /// On `file://`, the file that holds `key` (read only through
    /// [`crate::local::open_regular`]: never a symlink, never a FIFO).
    pub(crate) fn local_file(&self, key: &str) -> Option<PathBuf> {
        self.local_object(key).map(|(root, rel)| root.join(rel))
    }

    /// On `file://`, the store's root directory and `key`'s path under it (with the store's
    /// prefix), for writes made here rather than through `object_store`.
    pub(crate) fn local_object(&self, key: &str) -> Option<(PathBuf, String)> {
        self.local_root
            .as_ref()
            .map(|root| (root.clone(), self.path(key).as_ref().to_string()))
    }

    /// The error for a failed local read of `key` by `op`: a missing file or one that is not
    /// a regular file says the object is missing (an integrity error, as a remote 404 is).
    pub(crate) fn local_error(&self, op: &'static str, key: &str, e: std::io::Error) -> Error {
        let kind = match e.kind() {
            std::io::ErrorKind::NotFound => StoreErrorKind::NotFound,
            std::io::ErrorKind::InvalidData => StoreErrorKind::NotARegularFile,
            std::io::ErrorKind::PermissionDenied => StoreErrorKind::PermissionDenied,
            _ => StoreErrorKind::Other,
        };
        Error::Store {
            store: self.display.clone(),
            op,
            key: key.to_string(),
            kind,
            message: e.to_string(),
        }
    }

    /// Whether calls cross a network: not a local directory, not memory (judged by the URL,
    /// so a wrapper made with [`Store::from_object_store`] says what it wraps).
    pub(crate) fn is_remote(&self) -> bool {
        self.local_root.is_none()
            && !self.display.starts_with("memory://")
            && !self.display.starts_with("file://")
    }

    /// The store's URL, with credentials removed.
    pub fn url(&self) -> &str {
        &self.display
    }

    /// A store over an existing backend (for tests and wrappers).
    pub fn from_object_store(inner: Arc<dyn ObjectStore>, prefix: &str, display: &str) -> Store {
        Store {
            inner,
            prefix: ObjPath::from(prefix),
            display: display.to_string(),
            local_root: None,
            opts: StoreOptions::default(),
            reads: Arc::default(),
        }
    }

    pub(crate) fn path(&self, key: &str) -> ObjPath {
        if self.prefix.as_ref().is_empty() {
            ObjPath::from(key)
        } else {
            ObjPath::from(format!("{}/{key}", self.prefix))
        }
    }

    /// The key relative to this store's prefix.
    pub(crate) fn rel_key<'a>(&self, p: &'a ObjPath) -> &'a str {
        let s = p.as_ref();
        if self.prefix.as_ref().is_empty() {
            s
        } else {
            s.strip_prefix(self.prefix.as_ref())
                .and_then(|r| r.strip_prefix('/'))
                .unwrap_or(s)
        }
    }

    pub(crate) fn err(&self, op: &'static str, key: &str, e: object_store::Error) -> Error {
        Error::from_store(&self.display, op, key, e)
    }

    /// Runs `f` with retries on transient errors, a total deadline and cancellation.
    pub(crate) async fn retry<T, F, Fut>(
        &self,
        op: &'static str,
        key: &str,
        cancel: &CancellationToken,
        mut f: F,
    ) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let what = format!("{op} {key} on {}", self.display);
        let deadline_ms = self.opts.deadline_ms;
        let body = async {
            let mut backoff_ms = self.opts.backoff_initial_ms.max(1);
            let mut attempt = 1u32;
            loop {
                match f().await {
                    Ok(v) => return Ok(v),
                    Err(e) if e.is_permanent() || attempt >= self.opts.attempts_max => {
                        return Err(e);
                    }
                    Err(e) => {
                        let jitter = rand::rng().random_range(0..=backoff_ms / 2);
                        tracing::warn!(op, key, attempt, error = %e, "retrying store call");
                        tokio::time::sleep(Duration::from_millis(backoff_ms + jitter)).await;
                        backoff_ms = (backoff_ms * 2).min(self.opts.backoff_max_ms.max(1));
                        attempt += 1;
                    }
                }
            }
        };
        tokio::select! {
            biased;
            _ = cancel.cancelled() => Err(Error::Cancelled { op: what }),
            r = tokio::time::timeout(Duration::from_millis(deadline_ms), body) => match r {
                Ok(r) => r,
                Err(_) => Err(Error::Timeout { op: what, deadline_ms }),
            },
        }
    }

    /// Reads a whole object. On `file://` the object is read here rather than through
    /// `object_store`, so that only a regular file is ever opened: a FIFO planted where a
    /// manifest belongs would block an open forever, and a symlink would lead outside.
    pub(crate) async fn get(&self, key: &str, cancel: &CancellationToken) -> Result<Bytes> {
        if let Some(file) = self.local_file(key) {
            let read = tokio::task::spawn_blocking(move || {
                use std::io::Read;
                let mut f = crate::local::open_regular(&file)?;
                let mut buf = Vec::new();
                f.read_to_end(&mut buf)?;
                Ok::<_, std::io::Error>(buf)
            });
            let r = tokio::select! {
                biased;
                _ = cancel.cancelled() => return Err(Error::Cancelled { op: format!("get {key} on {}", self.display) }),
                r = read => r.map_err(|e| Error::task_failed("read", e))?,
            };
            let b = r
                .map(Bytes::from)
                .map_err(|e| self.local_error("get", key, e))?;
            self.count_read(b.len() as u64);
            return Ok(b);
        }
        let path = self.path(key);
        self.retry("get", key, cancel, || async {
            let r = self
                .inner
                .get(&path)
                .await
                .map_err(|e| self.err("get", key, e))?;
            let b = r.bytes().await.map_err(|e| self.err("get", key, e))?;
            self.count_read(b.len() as u64);
            Ok(b)
        })
        .await
    }

    /// Reads a whole object, refusing one over `max_bytes` (checked before the body).
    pub(crate) async fn get_bounded(
        &self,
        key: &str,
        max_bytes: u64,
        cancel: &CancellationToken,
    ) -> Result<Bytes> {
        let meta = self.head(key, cancel).await?;
        if meta > max_bytes {
            return Err(Error::Store {
                store: self.display.clone(),
                op: "get",
                key: key.to_string(),
                kind: StoreErrorKind::NotSupported,
                message: format!("object of {meta} bytes is over the limit of {max_bytes}"),
            });
        }
        let b = self.get(key, cancel).await?;
        if b.len() as u64 > max_bytes {
            return Err(Error::Store {
                store: self.display.clone(),
                op: "get",
                key: key.to_string(),
                kind: StoreErrorKind::NotSupported,
                message: format!("object grew over the limit of {max_bytes}"),
            });
        }
        Ok(b)
    }

    /// The size of an object. On `file://` from `lstat`, since `object_store` opens the file
    /// to stat it, and opening a FIFO blocks.
    pub(crate) async fn head(&self, key: &str, cancel: &CancellationToken) -> Result<u64> {
        self.reads.heads.fetch_add(1, Ordering::Relaxed);
        if let Some(file) = self.local_file(key) {
            let kind_of = |kind| Error::Store {
                store: self.display.clone(),
                op: "head",
                key: key.to_string(),
                kind,
                message: format!("{} is not a regular file", file.display()),
            };
            return match std::fs::symlink_metadata(&file) {
                Ok(m) if m.is_file() => Ok(m.len()),
                // A directory is no object, as object_store has it.
                Ok(m) if m.is_dir() => Err(kind_of(StoreErrorKind::NotFound)),
                Ok(_) => Err(kind_of(StoreErrorKind::NotARegularFile)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    Err(kind_of(StoreErrorKind::NotFound))
                }
                Err(e) => Err(Error::io(&file, e)),
            };
        }
        let path = self.path(key);
        self.retry("head", key, cancel, || async {
            self.inner
                .head(&path)
                .await
                .map(|m| m.size)
                .map_err(|e| self.err("head", key, e))
        })
        .await
    }

    /// Writes an object (overwriting), multipart when large, durable on return.
    pub(crate) async fn put(
        &self,
        key: &str,
        data: Bytes,
        cancel: &CancellationToken,
    ) -> Result<()> {
        let path = self.path(key);
        self.retry("put", key, cancel, || async {
            if data.len() >= self.opts.multipart_threshold_bytes {
                let upload = self
                    .inner
                    .put_multipart(&path)
                    .await
                    .map_err(|e| self.err("put", key, e))?;
                let mut w = object_store::WriteMultipart::new_with_chunk_size(
                    upload,
                    self.opts.multipart_part_bytes.max(5 * 1024 * 1024),
                );
                w.put(data.clone());
                w.finish().await.map_err(|e| self.err("put", key, e))?;
            } else {
                self.inner
                    .put(&path, PutPayload::from_bytes(data.clone()))
                    .await
                    .map_err(|e| self.err("put", key, e))?;
            }
            Ok(())
        })
        .await?;
        self.fsync_local(key).await
    }

    /// Writes an object only if none exists. `Ok(false)` when one already existed.
    pub(crate) async fn put_create(
        &self,
        key: &str,
        data: Bytes,
        cancel: &CancellationToken,
    ) -> Result<bool> {
        let path = self.path(key);
        let r = self
            .retry("create", key, cancel, || async {
                let opts = PutOptions {
                    mode: PutMode::Create,
                    ..Default::default()
                };
                self.inner
                    .put_opts(&path, PutPayload::from_bytes(data.clone()), opts)
                    .await
                    .map_err(|e| self.err("create", key, e))
            })
            .await;
        match r {
            Ok(_) => {
                self.fsync_local(key).await?;
                Ok(true)
            }
            Err(e) if e.store_kind() == Some(StoreErrorKind::AlreadyExists) => Ok(false),
            // A retried create whose first attempt landed answers Precondition on some stores.
            Err(e) if e.store_kind() == Some(StoreErrorKind::Precondition) => Ok(false),
            Err(e) => Err(e),
        }
    }

    pub(crate) async fn delete(&self, key: &str, cancel: &CancellationToken) -> Result<()> {
        let path = self.path(key);
        let r = self
            .retry("delete", key, cancel, || async {
                self.inner
                    .delete(&path)
                    .await
                    .map_err(|e| self.err("delete", key, e))
            })
            .await;
        match r {
            Err(e) if e.store_kind() == Some(StoreErrorKind::NotFound) => Ok(()),
            r => r,
        }
    }

    /// Lists every object under `dir` (recursively): relative keys, sizes and modified times.
    pub(crate) async fn list(
        &self,
        dir: &str,
        cancel: &CancellationToken,
    ) -> Result<Vec<(String, u64, i64)>> {
        use futures::TryStreamExt;
        self.reads.lists.fetch_add(1, Ordering::Relaxed);
        let path = self.path(dir);
        self.retry("list", dir, cancel, || async {
            let metas: Vec<object_store::ObjectMeta> = self
                .inner
                .list(Some(&path))
                .try_collect()
                .await
                .map_err(|e| self.err("list", dir, e))?;
            Ok(metas
                .into_iter()
                .map(|m| {
                    (
                        self.rel_key(&m.location).to_string(),
                        m.size,
                        m.last_modified.timestamp_millis(),
                    )
                })
                .collect())
        })
        .await
    }

    /// Lists the immediate sub-directories of `dir`, as names.
    pub(crate) async fn list_dirs(
        &self,
        dir: &str,
        cancel: &CancellationToken,
    ) -> Result<Vec<String>> {
        let path = self.path(dir);
        self.retry("list", dir, cancel, || async {
            let r = self
                .inner
                .list_with_delimiter(Some(&path))
                .await
                .map_err(|e| self.err("list", dir, e))?;
            Ok(r.common_prefixes
                .iter()
                .filter_map(|p| p.filename().map(str::to_string))
                .collect())
        })
        .await
    }

    /// On `file://`, removes what is left of a directory after its objects were deleted:
    /// empty directories (which a listing would still show) and staged uploads of a writer
    /// that was killed mid-put (which a listing never shows).
    pub(crate) async fn remove_local_dir(&self, dir: &str) -> Result<()> {
        let Some(root) = &self.local_root else {
            return Ok(());
        };
        let path = root.join(self.path(dir).as_ref());
        tokio::task::spawn_blocking(move || match std::fs::remove_dir_all(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io(&path, e)),
            _ => Ok(()),
        })
        .await
        .map_err(|e| Error::task_failed("remove", e))?
    }

    /// On `file://`, makes a written object durable: fsync the file and its directory.
    async fn fsync_local(&self, key: &str) -> Result<()> {
        let Some(file) = self.local_file(key) else {
            return Ok(());
        };
        tokio::task::spawn_blocking(move || crate::local::fsync_file_and_dir(&file))
            .await
            .map_err(|e| Error::task_failed("fsync", e))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compression_pays_on_remote_stores_only() {
        use crate::Compression;
        let dir = tempfile::tempdir().unwrap();
        let local = Store::open(&format!("file://{}", dir.path().display())).unwrap();
        let mem = Store::open("memory://").unwrap();
        let s3 = Store::open_with_options(
            "s3://bucket/job",
            [
                ("aws_region", "us-east-1"),
                ("aws_access_key_id", "k"),
                ("aws_secret_access_key", "s"),
            ],
        )
        .unwrap();
        assert!(!local.compression_pays() && !mem.compression_pays() && s3.compression_pays());
        assert!(!Compression::Auto.for_store(&local) && Compression::Auto.for_store(&s3));
        assert!(Compression::Always.for_store(&local) && !Compression::Never.for_store(&s3));
    }

    #[test]
    fn urls_in_errors_and_display_carry_no_credentials() {
        let err = Store::open("ftp://user:hunter2@host/x?sig=abc").unwrap_err();
        let msg = err.to_string();
        assert!(!msg.contains("hunter2") && !msg.contains("abc"), "{msg}");
        assert!(msg.contains("unsupported scheme"), "{msg}");
        let s = Store::open("memory:///pre/fix").unwrap();
        assert_eq!(s.url(), "memory:///pre/fix");
        assert_eq!(s.path("steps/x").as_ref(), "pre/fix/steps/x");
    }

    #[test]
    fn plain_paths_open_as_file_urls() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("ck");
        let s = Store::open(p.to_str().unwrap()).unwrap();
        assert!(p.is_dir());
        assert!(s.url().starts_with("file://"));
    }
}
