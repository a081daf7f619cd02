//! Single etcd operations with their fencing conditions. Each is bounded by a timeout and maps
//! errors into [`Error`] with the key it touched.

use std::future::Future;
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp};

use crate::keys::Keys;
use crate::record::{self, CommitRecord, EpochRecord, Generation, LeaderRecord, WaitingRecord};
use crate::{Error, Result};

/// Runs one etcd call with a deadline.
pub(crate) async fn bounded<T>(
    op: &'static str,
    key: &str,
    timeout_ms: u64,
    fut: impl Future<Output = std::result::Result<T, etcd_client::Error>>,
) -> Result<T> {
    match tokio::time::timeout(Duration::from_millis(timeout_ms), fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Error::etcd(op, key, e)),
        Err(_) => Err(Error::Timeout {
            op,
            after_ms: timeout_ms,
        }),
    }
}

/// Tries to become the leader: a create-only put of the leader key attached to `lease_id`.
/// Returns whether this node now leads.
pub async fn campaign(
    client: &mut Client,
    keys: &Keys,
    node_id: &str,
    lease_id: i64,
    timeout_ms: u64,
) -> Result<bool> {
    let key = keys.leader();
    let value = record::encode(&LeaderRecord {
        version: record::RECORD_VERSION,
        node_id: node_id.to_string(),
        lease_id,
    });
    let txn = Txn::new()
        .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
        .and_then([TxnOp::put(
            key.clone(),
            value,
            Some(PutOptions::new().with_lease(lease_id)),
        )]);
    let resp = bounded("campaign", &key, timeout_ms, client.txn(txn)).await?;
    Ok(resp.succeeded())
}

/// The leader's fenced generation write. It succeeds only while the leader key is attached to
/// `leader_lease_id` and the generation key's mod revision is still `prev_mod_revision` (0 when
/// the key is absent). Returns the new mod revision; a deposed leader gets
/// [`Error::NotLeader`]. It does not move `ctl/epoch` (the rendezvous driver does, in the same
/// transaction, for every new generation).
pub async fn write_generation(
    client: &mut Client,
    keys: &Keys,
    node_id: &str,
    leader_lease_id: i64,
    prev_mod_revision: i64,
    generation: &Generation,
    timeout_ms: u64,
) -> Result<i64> {
    write_generation_and_epoch(
        client,
        keys,
        node_id,
        leader_lease_id,
        prev_mod_revision,
        generation,
        None,
        None,
        None,
        timeout_ms,
    )
    .await
}

/// [`write_generation`], and with `epoch_lease`, `ctl/epoch` set to the generation's number
/// under that retention lease in the same transaction: a generation is never visible without
/// the epoch that keeps its number from being used again after a total loss. With
/// `commit_mod_revision`, it also fails (as [`Error::NotLeader`]: re-read and decide again)
/// when `ctl/commit` changed since the leader read it, so a generation never names an older
/// resume step than the newest commit recorded when it is frozen. With `commit`, `ctl/commit`
/// is put (under the leader's lease) in the same transaction: the leader knew of a newer
/// commit than etcd recorded, and the generation resumes from it.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn write_generation_and_epoch(
    client: &mut Client,
    keys: &Keys,
    node_id: &str,
    leader_lease_id: i64,
    prev_mod_revision: i64,
    generation: &Generation,
    epoch_lease: Option<i64>,
    commit_mod_revision: Option<i64>,
    commit: Option<&CommitRecord>,
    timeout_ms: u64,
) -> Result<i64> {
    let key = keys.generation();
    // Check before writing: never put a record a reader would reject.
    generation.validate(&key)?;
    let mut ops = vec![
        TxnOp::put(
            key.clone(),
            record::encode(generation),
            Some(PutOptions::new().with_lease(leader_lease_id)),
        ),
        // A new generation ends any "waiting below min" notice.
        TxnOp::delete(keys.waiting(), None),
    ];
    if let Some(lease) = epoch_lease {
        let epoch = EpochRecord {
            version: record::RECORD_VERSION,
            number: generation.number,
        };
        ops.push(TxnOp::put(
            keys.epoch(),
            record::encode(&epoch),
            Some(PutOptions::new().with_lease(lease)),
        ));
    }
    if let Some(c) = commit {
        ops.push(TxnOp::put(
            keys.commit(),
            record::encode(c),
            Some(PutOptions::new().with_lease(leader_lease_id)),
        ));
    }
    let mut when = vec![
        Compare::lease(keys.leader(), CompareOp::Equal, leader_lease_id),
        Compare::mod_revision(key.clone(), CompareOp::Equal, prev_mod_revision),
    ];
    if let Some(rev) = commit_mod_revision {
        when.push(Compare::mod_revision(keys.commit(), CompareOp::Equal, rev));
    }
    let txn = Txn::new().when(when).and_then(ops);
    let resp = bounded("write generation", &key, timeout_ms, client.txn(txn)).await?;
    if !resp.succeeded() {
        return Err(Error::NotLeader {
            job: keys.prefix().to_string(),
            node: node_id.to_string(),
            key,
        });
    }
    Ok(resp.header().map(|h| h.revision()).unwrap_or(0))
}

/// Moves `ctl/epoch` (holding `number`) to `epoch_lease`, fenced on leadership. Returns whether
/// this node still leads.
pub(crate) async fn write_epoch(
    client: &mut Client,
    keys: &Keys,
    leader_lease_id: i64,
    number: u64,
    epoch_lease: i64,
    timeout_ms: u64,
) -> Result<bool> {
    let key = keys.epoch();
    let epoch = EpochRecord {
        version: record::RECORD_VERSION,
        number,
    };
    let txn = Txn::new()
        .when([Compare::lease(
            keys.leader(),
            CompareOp::Equal,
            leader_lease_id,
        )])
        .and_then([TxnOp::put(
            key.clone(),
            record::encode(&epoch),
            Some(PutOptions::new().with_lease(epoch_lease)),
        )]);
    let resp = bounded("write epoch", &key, timeout_ms, client.txn(txn)).await?;
    Ok(resp.succeeded())
}

/// Puts the commit record under the current leader's lease, fenced on that leader and on the
/// commit key's mod revision (so a concurrent writer of an older step cannot overwrite it).
pub(crate) async fn write_commit(
    client: &mut Client,
    keys: &Keys,
    leader: &LeaderRecord,
    prev_mod_revision: i64,
    commit: &CommitRecord,
    timeout_ms: u64,
) -> Result<bool> {
    let key = keys.commit();
    let txn = Txn::new()
        .when([
            Compare::lease(keys.leader(), CompareOp::Equal, leader.lease_id),
            Compare::mod_revision(key.clone(), CompareOp::Equal, prev_mod_revision),
        ])
        .and_then([TxnOp::put(
            key.clone(),
            record::encode(commit),
            Some(PutOptions::new().with_lease(leader.lease_id)),
        )]);
    let resp = bounded("write commit", &key, timeout_ms, client.txn(txn)).await?;
    Ok(resp.succeeded())
}

/// Puts the leader's waiting notice, fenced on leadership.
pub(crate) async fn write_waiting(
    client: &mut Client,
    keys: &Keys,
    leader_lease_id: i64,
    waiting: &WaitingRecord,
    timeout_ms: u64,
) -> Result<bool> {
    let key = keys.waiting();
    let txn = Txn::new()
        .when([Compare::lease(
            keys.leader(),
            CompareOp::Equal,
            leader_lease_id,
        )])
        .and_then([TxnOp::put(
            key.clone(),
            record::encode(waiting),
            Some(PutOptions::new().with_lease(leader_lease_id)),
        )]);
    let resp = bounded("write waiting", &key, timeout_ms, client.txn(txn)).await?;
    Ok(resp.succeeded())
}

/// Milliseconds since the Unix epoch (wall clock, for records other hosts read).
pub(crate) fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Puts a member's request (`ctl/restart/<node>`, `ctl/regroup/<node>`) under its lease: a
/// [`RestartRecord`] naming `generation`, with `reason` cut to
/// [`record::REASON_BYTES_MAX`] bytes.
pub(crate) async fn put_member_request(
    client: &mut etcd_client::Client,
    key: &str,
    node_id: &str,
    lease_id: i64,
    generation: u64,
    reason: &str,
    timeout_ms: u64,
) -> crate::Result<()> {
    if generation == 0 {
        return Err(crate::Error::InvalidConfig {
            field: "generation",
            reason: "generation numbers start at 1".into(),
        });
    }
    let mut end = reason.len().min(crate::record::REASON_BYTES_MAX);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let rec = crate::record::RestartRecord {
        version: crate::record::RECORD_VERSION,
        generation,
        node_id: node_id.to_string(),
        reason: reason[..end].to_string(),
        requested_unix_ms: now_unix_ms(),
    };
    bounded(
        "member request",
        key,
        timeout_ms,
        client.put(
            key.to_string(),
            crate::record::encode(&rec),
            Some(etcd_client::PutOptions::new().with_lease(lease_id)),
        ),
    )
    .await?;
    Ok(())
}
