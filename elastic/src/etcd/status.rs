//! `elastic-run status`: a job read once, without joining.

use std::collections::BTreeSet;

use etcd_client::GetOptions;

use super::view::View;
use super::{Connect, REQUEST_TIMEOUT_MS_DEFAULT, ops};
use crate::keys::Keys;
use crate::record::{
    self, CommitRecord, Generation, JobState, MemberRecord, WaitingRecord, validate_node_id,
};
use crate::{Error, Result};

/// A job as `elastic-run status` shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Status {
    pub members: Vec<MemberRecord>,
    pub draining: BTreeSet<String>,
    pub leader: Option<String>,
    pub generation: Option<Generation>,
    pub latest_commit: Option<CommitRecord>,
    pub job_state: Option<JobState>,
    pub waiting: Option<WaitingRecord>,
}

/// Reads a job's members, generation, newest commit and outcome, without joining.
pub async fn status(connect: &Connect, job_id: &str) -> Result<Status> {
    validate_node_id(job_id).map_err(|reason| Error::InvalidConfig {
        field: "job_id",
        reason,
    })?;
    let keys = Keys::new(job_id);
    let mut client = connect.client(REQUEST_TIMEOUT_MS_DEFAULT).await?;
    let resp = ops::bounded(
        "get",
        keys.prefix(),
        connect.request_timeout_ms,
        client.get(keys.prefix(), Some(GetOptions::new().with_prefix())),
    )
    .await?;
    let mut view = View::default();
    for kv in resp.kvs() {
        let key = kv.key_str().map_err(|e| Error::BadValue {
            key: String::from_utf8_lossy(kv.key()).into_owned(),
            reason: e.to_string(),
        })?;
        // Parse strictly here: status reports a bad value instead of skipping it.
        if key == keys.generation() {
            let _: Generation = record::parse(key, kv.value())?;
        }
        view.apply(&keys, key, Some(kv.value()), kv.mod_revision(), kv.lease());
    }
    Ok(Status {
        members: view.members.into_values().collect(),
        draining: view.draining,
        leader: view.leader.map(|l| l.node_id),
        generation: view.generation.map(|g| Generation::clone(&g)),
        latest_commit: view.commit,
        job_state: view.state,
        waiting: view.waiting,
    })
}
