//! The crate's public error type.
//!
//! Every variant carries the context a user needs to act (store, key, step, file). Store
//! errors are scrubbed of credentials before they are kept: signatures, SAS tokens and
//! user-info never reach a message or a log line.

use std::path::PathBuf;

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong with an object-store call, coarsely, for the retrier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreErrorKind {
    NotFound,
    AlreadyExists,
    Precondition,
    NotSupported,
    Unauthenticated,
    PermissionDenied,
    InvalidPath,
    /// On a local store, something other than a regular file (a FIFO, a symlink, a device)
    /// stands where an object belongs: bad data, never opened.
    NotARegularFile,
    /// Anything else (network, 5xx, throttling): worth retrying.
    Other,
}

/// Errors from checkpoint operations.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("invalid checkpoint URL {url}: {reason}")]
    InvalidUrl { url: String, reason: String },

    #[error("{store}: {op} {key}: {message}")]
    Store {
        store: String,
        op: &'static str,
        key: String,
        kind: StoreErrorKind,
        message: String,
    },

    #[error("{store}: step {step} already exists (it has a manifest)")]
    StepExists { store: String, step: u64 },

    #[error("{store}: step {step} is not committed (no manifest)")]
    StepNotFound { store: String, step: u64 },

    #[error("{store}: no committed step verifies")]
    NoCommittedStep { store: String },

    #[error("{store}: step {step}: corrupt object {key}: {reason}")]
    Corrupt {
        store: String,
        step: u64,
        key: String,
        reason: String,
    },

    #[error("{store}: invalid manifest {key}: {reason}")]
    InvalidManifest {
        store: String,
        key: String,
        reason: String,
    },

    #[error(
        "{store}: manifest {key} has format version {version}; this build reads version {supported}"
    )]
    UnsupportedVersion {
        store: String,
        key: String,
        version: u64,
        supported: u32,
    },

    #[error("invalid safetensors file {file}: {reason}")]
    InvalidSafetensors { file: String, reason: String },

    #[error("invalid name {name:?}: {reason}")]
    InvalidName { name: String, reason: String },

    #[error("invalid input: {0}")]
    InvalidInput(String),

    #[error("{store}: cannot commit step {step}: {reason}")]
    Incomplete {
        store: String,
        step: u64,
        reason: String,
    },

    /// The step can never be committed as staged (over a format limit, empty): retrying
    /// the same parts cannot help, and nothing was written.
    #[error("{store}: step {step} is refused: {reason}")]
    Rejected {
        store: String,
        step: u64,
        reason: String,
    },

    /// A writer the commit waits for gave the step up (see `format`'s abandonment marker):
    /// its part will never come.
    #[error("{store}: step {step} was given up by writer {writer}: {reason}")]
    Abandoned {
        store: String,
        step: u64,
        writer: String,
        reason: String,
    },

    /// An entry of a step's state that cannot be exported as a model's weights: the step
    /// does not hold it, it is not a flat map of names to tensors (an optimizer's state), or
    /// its description in the manifest's metadata is malformed. Says nothing about the stored
    /// data, so no read falls back past it.
    #[error("{store}: step {step}: cannot export {key:?}: {reason}")]
    NotExportable {
        store: String,
        step: u64,
        key: String,
        reason: String,
    },

    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{op} was cancelled")]
    Cancelled { op: String },

    #[error("{op} timed out after {deadline_ms} ms")]
    Timeout { op: String, deadline_ms: u64 },

    /// A blocking task this crate ran (reading, encoding, decoding, writing or fsyncing on
    /// the blocking pool) panicked or was cancelled: a fault of this process, not of the
    /// input or of the stored data. `task` names the work, `message` is the task's failure.
    #[error("{task} task failed: {message}")]
    TaskFailed { task: &'static str, message: String },
}

impl Error {
    /// Whether retrying the same call cannot help. The retrier stops on these.
    pub fn is_permanent(&self) -> bool {
        match self {
            Error::Store { kind, .. } => *kind != StoreErrorKind::Other,
            Error::Io { source, .. } => !matches!(
                source.kind(),
                std::io::ErrorKind::Interrupted
                    | std::io::ErrorKind::TimedOut
                    | std::io::ErrorKind::WouldBlock
            ),
            // A panicked or cancelled task is a fault of this process: the same call again
            // cannot be expected to do better.
            Error::TaskFailed { .. } => true,
            _ => true,
        }
    }

    /// Whether this error says the stored data is bad or missing (as opposed to the store
    /// being unreachable): restore falls back to an older step on these.
    pub fn is_integrity(&self) -> bool {
        match self {
            Error::Corrupt { .. }
            | Error::InvalidManifest { .. }
            | Error::UnsupportedVersion { .. }
            | Error::InvalidSafetensors { .. }
            | Error::InvalidName { .. } => true,
            Error::Store { kind, .. } => {
                matches!(
                    kind,
                    StoreErrorKind::NotFound | StoreErrorKind::NotARegularFile
                )
            }
            // Says nothing about the stored data: no fallback to an older step for it.
            Error::TaskFailed { .. } => false,
            _ => false,
        }
    }

    /// The error for a blocking task (`tokio::task::spawn_blocking`) named `task` that
    /// panicked or was cancelled instead of returning.
    pub(crate) fn task_failed(task: &'static str, e: tokio::task::JoinError) -> Self {
        Error::TaskFailed {
            task,
            message: e.to_string(),
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn from_store(
        store: &str,
        op: &'static str,
        key: &str,
        err: object_store::Error,
    ) -> Self {
        use object_store::Error as E;
        let kind = match &err {
            E::NotFound { .. } => StoreErrorKind::NotFound,
            E::AlreadyExists { .. } => StoreErrorKind::AlreadyExists,
            E::Precondition { .. } => StoreErrorKind::Precondition,
            E::NotSupported { .. } | E::NotImplemented { .. } => StoreErrorKind::NotSupported,
            E::Unauthenticated { .. } => StoreErrorKind::Unauthenticated,
            E::PermissionDenied { .. } => StoreErrorKind::PermissionDenied,
            E::InvalidPath { .. } => StoreErrorKind::InvalidPath,
            _ => StoreErrorKind::Other,
        };
        Error::Store {
            store: store.to_string(),
            op,
            key: key.to_string(),
            kind,
            message: redact(&err.to_string()),
        }
    }

    pub(crate) fn store_kind(&self) -> Option<StoreErrorKind> {
        match self {
            Error::Store { kind, .. } => Some(*kind),
            _ => None,
        }
    }
}

/// Query parameters whose values are secrets (S3 presigning, Azure SAS, GCS signed URLs).
const SECRET_PARAMS: &[&str] = &[
    "sig=",
    "x-amz-signature=",
    "x-amz-credential=",
    "x-amz-security-token=",
    "x-goog-signature=",
    "x-goog-credential=",
    "access_token=",
    "token=",
];

/// Removes secrets from a message: values of signing query parameters and URL user-info.
pub(crate) fn redact(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let lower = message.to_ascii_lowercase();
    let bytes = message.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if let Some(p) = SECRET_PARAMS.iter().find(|p| {
            lower[i..].starts_with(**p) && (i == 0 || matches!(bytes[i - 1], b'?' | b'&'))
        }) {
            out.push_str(&message[i..i + p.len()]);
            out.push_str("REDACTED");
            i += p.len();
            while i < bytes.len() && !matches!(bytes[i], b'&' | b' ' | b'"' | b'\'' | b'\n') {
                i += 1;
            }
            continue;
        }
        let ch = message[i..].chars().next().unwrap_or('\0');
        out.push(ch);
        i += ch.len_utf8().max(1);
    }
    redact_userinfo(&out)
}

/// `scheme://user:pass@host` becomes `scheme://REDACTED@host`.
pub(crate) fn redact_userinfo(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(pos) = rest.find("://") {
        let (head, tail) = rest.split_at(pos + 3);
        out.push_str(head);
        let end = tail
            .find(|c: char| c == '/' || c.is_whitespace() || c == '"')
            .unwrap_or(tail.len());
        match tail[..end].rfind('@') {
            Some(at) => {
                out.push_str("REDACTED");
                out.push_str(&tail[at..end]);
            }
            None => out.push_str(&tail[..end]),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redact_removes_signatures_and_userinfo() {
        let m = "GET https://u:secretpw@acct.blob/c/k?sv=1&sig=abc%2Fdef&se=2 failed";
        let r = redact(m);
        assert!(!r.contains("abc"), "{r}");
        assert!(!r.contains("secretpw"), "{r}");
        assert!(r.contains("sig=REDACTED&se=2"), "{r}");
        let m = "url http://h/k?X-Amz-Credential=AKIA123&X-Amz-Signature=ff00";
        let r = redact(m);
        assert!(!r.contains("AKIA123") && !r.contains("ff00"), "{r}");
    }

    #[tokio::test]
    async fn a_panicked_blocking_task_is_a_task_failure_naming_the_task() {
        let join = tokio::task::spawn_blocking(|| -> Result<()> { panic!("boom in the pool") })
            .await
            .unwrap_err();
        let e = Error::task_failed("encode", join);
        assert!(
            matches!(&e, Error::TaskFailed { task: "encode", message } if message.contains("boom in the pool")),
            "{e:?}"
        );
        let shown = e.to_string();
        assert!(shown.starts_with("encode task failed: "), "{shown}");
        assert!(shown.contains("panicked"), "{shown}");
        assert!(!shown.contains("invalid input"), "{shown}");
        // Not bad stored data: a restore does not fall back past a step for it.
        assert!(!e.is_integrity());
        assert!(e.store_kind().is_none());
        // Permanent for the retrier, as before: retrying the store call cannot fix it.
        assert!(e.is_permanent());
    }

    #[test]
    fn only_transient_store_errors_are_retried() {
        let e = Error::from_store(
            "s3://b",
            "get",
            "k",
            object_store::Error::NotFound {
                path: "k".into(),
                source: "gone".into(),
            },
        );
        assert!(e.is_permanent());
        assert!(e.is_integrity());
        let e = Error::from_store(
            "s3://b",
            "get",
            "k",
            object_store::Error::Generic {
                store: "S3",
                source: "connection reset".into(),
            },
        );
        assert!(!e.is_permanent());
        assert!(
            Error::Timeout {
                op: "x".into(),
                deadline_ms: 1
            }
            .is_permanent()
        );
    }
}
