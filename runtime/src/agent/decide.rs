//! The agent's pure decisions.

use elastic::{Generation, Snapshot};

/// Why a running group was asked to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StopWhy {
    NewGeneration,
    Fenced,
    Waiting,
    JobFailed,
}

/// Whether the running generation `g` must stop now, given what etcd shows.
pub(super) fn must_stop(snap: &Snapshot, g: &Generation) -> Option<StopWhy> {
    if let Some(newest) = &snap.generation
        && (newest.number, newest.created_unix_ms) != (g.number, g.created_unix_ms)
        && newest.created_unix_ms >= g.created_unix_ms
    {
        return Some(StopWhy::NewGeneration);
    }
    if snap
        .waiting
        .as_ref()
        .is_some_and(|w| w.generation == g.number)
    {
        return Some(StopWhy::Waiting);
    }
    if snap
        .job_state
        .as_ref()
        .is_some_and(|s| s.outcome == elastic::record::Outcome::Failed)
    {
        return Some(StopWhy::JobFailed);
    }
    None
}

/// Whether a failed restore may succeed when tried again: local I/O (a full staging disk)
/// and store trouble may pass; a bad request or a cancellation does not. A step that does
/// not verify never reaches here: the sink falls back to an older one.
pub(super) fn restore_is_retryable(e: &crate::store_sink::SinkError) -> bool {
    use crate::store_sink::SinkError as E;
    match e {
        E::Cancelled { .. } | E::InvalidInput(_) => false,
        E::Restore { source, .. } => !source.is_integrity(),
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_disk_or_an_unreachable_store_is_retried_but_bad_data_and_cancels_are_not() {
        use crate::store_sink::SinkError as E;
        let full = E::Io {
            op: "write",
            path: "/dev/shm/x".into(),
            source: std::io::Error::from(std::io::ErrorKind::StorageFull),
        };
        assert!(restore_is_retryable(&full));
        let restore = |source| E::Restore {
            step: 7,
            rank: 0,
            world: 2,
            url: "file:///b".into(),
            source: Box::new(source),
        };
        let enospc = checkpoint::Error::Io {
            path: "/dev/shm/x".into(),
            source: std::io::Error::from(std::io::ErrorKind::StorageFull),
        };
        assert!(restore_is_retryable(&restore(enospc)));
        let corrupt = checkpoint::Error::Corrupt {
            store: "file:///b".into(),
            step: 7,
            key: "k".into(),
            reason: "crc32c".into(),
        };
        assert!(!restore_is_retryable(&restore(corrupt)));
        assert!(!restore_is_retryable(&E::Cancelled { op: "x".into() }));
        assert!(!restore_is_retryable(&E::InvalidInput("x".into())));
    }
}
