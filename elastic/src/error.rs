//! The crate's public error type. Every variant carries the context a caller needs to act on it
//! (the etcd key, the job, the node, the limit that was hit).

/// Everything that can go wrong in membership, rendezvous and scaling.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An etcd call failed (connection refused, timeout inside the client, auth, ...).
    #[error("etcd {op} on {key}: {source}")]
    Etcd {
        op: &'static str,
        key: String,
        #[source]
        source: etcd_client::Error,
    },
    /// A value read from etcd could not be parsed or failed validation.
    #[error("bad value at etcd key {key}: {reason}")]
    BadValue { key: String, reason: String },
    /// A record was written by a newer (or unknown) format version.
    #[error("etcd key {key} holds record version {found}, this build reads version {supported}")]
    UnsupportedVersion {
        key: String,
        found: u32,
        supported: u32,
    },
    /// A configuration value is out of range.
    #[error("invalid configuration: {field}: {reason}")]
    InvalidConfig { field: &'static str, reason: String },
    /// The scaling inputs are inconsistent (zero batch, zero world size, ...).
    #[error("invalid scaling input: {reason}")]
    InvalidScaling { reason: String },
    /// `fixed` scaling splits the global batch into per-worker batches, so it needs the
    /// per-worker batch (the runtime's `--batch-size`).
    #[error("--lr-scaling fixed needs --batch-size (and optionally --global-batch)")]
    FixedNeedsBatch,
    /// `fixed` scaling was asked to refuse a global batch that the world size cannot divide.
    #[error(
        "global batch {global_batch} is not divisible by per-worker batch {per_worker_batch} x world size {world_size} (x any grad-accumulation steps); refusing as configured"
    )]
    Indivisible {
        global_batch: u64,
        per_worker_batch: u64,
        world_size: u64,
    },
    /// This node's lease is gone (expired, revoked, or could not be renewed in time). The
    /// handle is dead; stop the workers and join again with a new handle.
    #[error("job {job} node {node}: fenced: {reason}")]
    Fenced {
        job: String,
        node: String,
        reason: String,
    },
    /// A fenced etcd write failed because this node no longer leads (or the generation moved on).
    #[error("job {job} node {node}: not the leader any more (write to {key} refused)")]
    NotLeader {
        job: String,
        node: String,
        key: String,
    },
    /// The job was marked finished.
    #[error("job {job} finished (success = {success})")]
    JobFinished { job: String, success: bool },
    /// The job was marked failed.
    #[error("job {job} failed: {reason}")]
    JobFailed { job: String, reason: String },
    /// An operation did not complete within its bound.
    #[error("{op} timed out after {after_ms} ms")]
    Timeout { op: &'static str, after_ms: u64 },
    /// The operation was cancelled because the handle was closed (left, finished or dropped).
    #[error("{op} cancelled: the rendezvous handle is closed")]
    Cancelled { op: &'static str },
    /// Another node with the same id is already registered in this job.
    #[error("job {job}: node id {node} is already registered")]
    DuplicateNode { job: String, node: String },
}

impl Error {
    /// Whether retrying the same call can help. Transport errors and timeouts are transient;
    /// bad values, bad configuration and fencing are not.
    pub fn is_permanent(&self) -> bool {
        !matches!(self, Error::Etcd { .. } | Error::Timeout { .. })
    }

    pub(crate) fn etcd(
        op: &'static str,
        key: impl Into<String>,
        source: etcd_client::Error,
    ) -> Self {
        Error::Etcd {
            op,
            key: key.into(),
            source,
        }
    }
}

/// Short alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
