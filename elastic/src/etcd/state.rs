//! The job's outcome, `ctl/state`: written once (by `finish`, or by the leader failing the job),
//! cleared when a new run of a finished job id starts, and the error agents get from it.

use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp};

use super::ops;
use crate::keys::{Keys, STATE_RETENTION_S};
use crate::record::{self, JobState, Outcome};
use crate::{Error, Result};

pub(super) fn job_state_error(job: &str, st: &JobState) -> Error {
    match st.outcome {
        Outcome::Succeeded => Error::JobFinished {
            job: job.to_string(),
            success: true,
        },
        Outcome::Failed => Error::JobFailed {
            job: job.to_string(),
            reason: st.reason.clone(),
        },
    }
}

/// Writes `ctl/state` under a fresh retention lease. With `leader_lease`, only while that lease
/// still holds the leader key.
pub(crate) async fn write_state(
    client: &mut Client,
    keys: &Keys,
    outcome: Outcome,
    reason: &str,
    leader_lease: Option<i64>,
    timeout_ms: u64,
) -> Result<()> {
    let key = keys.state();
    let retention = ops::bounded(
        "lease grant",
        &key,
        timeout_ms,
        client.lease_grant(STATE_RETENTION_S, None),
    )
    .await?;
    let state = JobState {
        version: record::RECORD_VERSION,
        outcome,
        reason: reason.to_string(),
        at_unix_ms: ops::now_unix_ms(),
    };
    // The first outcome written stands: a later `finish` (every agent may call it) is a no-op.
    let mut when = vec![Compare::create_revision(key.clone(), CompareOp::Equal, 0)];
    if let Some(l) = leader_lease {
        when.push(Compare::lease(keys.leader(), CompareOp::Equal, l));
    }
    let txn = Txn::new()
        .when(when)
        .and_then([TxnOp::put(
            key.clone(),
            record::encode(&state),
            Some(PutOptions::new().with_lease(retention.id())),
        )])
        .or_else([TxnOp::get(key.clone(), None)]);
    let resp = ops::bounded("write state", &key, timeout_ms, client.txn(txn)).await;
    let written = matches!(&resp, Ok(r) if r.succeeded());
    if !written {
        // Do not leave an empty day-long lease behind.
        let _ = ops::bounded(
            "lease revoke",
            &key,
            timeout_ms,
            client.lease_revoke(retention.id()),
        )
        .await;
    }
    let resp = resp?;
    if written {
        return Ok(());
    }
    let already = resp
        .op_responses()
        .into_iter()
        .any(|op| matches!(op, etcd_client::TxnOpResponse::Get(g) if !g.kvs().is_empty()));
    if already {
        return Ok(());
    }
    Err(Error::NotLeader {
        job: keys.prefix().to_string(),
        node: String::new(),
        key,
    })
}

/// A new run of a job id whose previous run finished: drop the old outcome, but only when no
/// leader is alive (a live job that is finishing keeps it).
pub(super) async fn clear_stale_state(
    client: &mut Client,
    keys: &Keys,
    job: &str,
    timeout_ms: u64,
) -> Result<()> {
    let key = keys.state();
    let txn = Txn::new()
        .when([Compare::create_revision(keys.leader(), CompareOp::Equal, 0)])
        .and_then([TxnOp::delete(key.clone(), None)])
        .or_else([TxnOp::get(key.clone(), None)]);
    let resp = ops::bounded("clear state", &key, timeout_ms, client.txn(txn)).await?;
    if !resp.succeeded() {
        for op in resp.op_responses() {
            if let etcd_client::TxnOpResponse::Get(g) = op
                && let Some(kv) = g.kvs().first()
            {
                let st: JobState = record::parse(&key, kv.value())?;
                return Err(job_state_error(job, &st));
            }
        }
    }
    Ok(())
}
