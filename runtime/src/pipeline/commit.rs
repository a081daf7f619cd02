//! The commit side of the sink.
//!
//! Every local rank's staged `rank-<R>/tensors.safetensors` is uploaded as its own part:
//! writer id `g<generation>-rank-<R>` (the generation in the id means a zombie of an older
//! generation can never have its part picked), file name `rank-<R>/tensors.safetensors` (file
//! names must be unique within a step, and this one mirrors the staging layout in
//! `elastic-ckpt pull`). Then the agent commits the step once every rank `0..world` of the
//! generation is durable. The other nodes upload theirs at the same time and every agent
//! races to commit: the checkpoint crate's create-only manifest makes exactly one win, the
//! others see `AlreadyCommitted`. An incomplete step is retried every
//! [`SinkOptions::retry_pause_ms`] until [`SinkOptions::commit_wait_ms`] passes or the commit
//! is cancelled (a lost peer never uploads its part). The manifest metadata is
//! `{"elastic": <agent metadata>, "state": <meta.json "state" of this node's lowest rank>}`;
//! every rank records the same replicated state, so any node can commit. After a commit this
//! node wrote, retention keeps the newest [`SinkOptions::keep_steps`] committed steps that
//! pass the cheap check (and every multiple of [`SinkOptions::keep_every`]); see `retain`.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use checkpoint::{
    CancellationToken, CommitOutcome, CommitRequest, Manifest, PartInput, PartSource,
    RetentionPolicy,
};
use tokio::time::Instant;
use tracing::Instrument;

use worker::protocol::{FORMAT_VERSION, STAGED_META, STAGED_TENSORS};

use crate::state::StagedPart;

use super::sink::*;

impl StoreSink {
    /// Uploads this node's parts, then commits the step once every rank `0..world_size` of
    /// the generation is durable (see the module docs).
    pub async fn commit(
        &self,
        s: StepToCommit,
        cancel: &CancellationToken,
    ) -> Result<Committed, SinkError> {
        let span = tracing::info_span!("commit", step = s.step, generation = s.generation);
        self.commit_inner(s, cancel).instrument(span).await
    }

    pub(super) async fn commit_inner(
        &self,
        s: StepToCommit,
        cancel: &CancellationToken,
    ) -> Result<Committed, SinkError> {
        let step = s.step;
        let cancelled = || SinkError::Cancelled {
            op: format!("commit of step {step}"),
        };
        if cancel.is_cancelled() {
            return Err(cancelled());
        }
        let mut parts = s.parts.clone();
        parts.sort_by_key(|p| p.rank);
        check_parts(step, s.world_size, &parts)?;
        // Every part is checked before any byte goes up; the state comes from the lowest rank.
        let state = {
            let (parts, world_size) = (parts.clone(), s.world_size);
            blocking(move || {
                let mut states = parts
                    .iter()
                    .map(|p| read_staged(step, world_size, p))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(states.swap_remove(0))
            })
            .await?
        };
        let t0 = Instant::now();

        // A step that is already committed (by an earlier generation that reached it) exists
        // for every reader: uploading again would only leave bytes for the collector.
        match self.store.read_manifest(step, cancel).await {
            Ok(m) => {
                tracing::info!(
                    step,
                    world = m.world_size,
                    "step already committed; nothing to upload"
                );
                return Ok(Committed {
                    step,
                    bytes: 0,
                    by_this_node: false,
                    upload_ms: 0,
                    commit_ms: t0.elapsed().as_millis() as u64,
                });
            }
            Err(checkpoint::Error::StepNotFound { .. }) => {}
            Err(_) if cancel.is_cancelled() => return Err(cancelled()),
            // Unreadable manifest: let the commit below decide (it reads it again).
            Err(e) => tracing::warn!(step, error = %e, "reading the step's manifest failed"),
        }

        let mut bytes = 0u64;
        for p in &parts {
            let input = PartInput {
                writer: writer_id(s.generation, p.rank),
                source: PartSource::Files(vec![(
                    format!("rank-{}/{STAGED_TENSORS}", p.rank),
                    p.dir.join(STAGED_TENSORS),
                )]),
                shards: Default::default(),
            };
            let t = Instant::now();
            let record = tokio::select! {
                r = self.store.save_part(step, input, &self.opts.save, cancel) => r,
                () = cancel.cancelled() => return Err(cancelled()),
            }
            .map_err(|source| {
                if cancel.is_cancelled() {
                    cancelled()
                } else {
                    SinkError::Upload {
                        step,
                        rank: p.rank,
                        url: self.url().to_string(),
                        source: Box::new(source),
                    }
                }
            })?;
            let part_bytes: u64 = record.objects.iter().map(|o| o.stored_bytes).sum();
            bytes += part_bytes;
            tracing::debug!(
                step,
                rank = p.rank,
                bytes = part_bytes,
                ms = t.elapsed().as_millis() as u64,
                "part durable"
            );
        }
        let upload_ms = t0.elapsed().as_millis() as u64;
        tracing::info!(
            step,
            bytes,
            upload_ms,
            ranks = parts.len(),
            "this node's parts are durable"
        );

        let req = CommitRequest {
            world_size: s.world_size,
            writers: (0..s.world_size)
                .map(|r| writer_id(s.generation, r))
                .collect(),
            metadata: serde_json::json!({"elastic": s.agent_metadata, "state": state}),
        };
        let t1 = Instant::now();
        let wait = Duration::from_millis(self.opts.commit_wait_ms);
        let pause = Duration::from_millis(self.opts.retry_pause_ms.max(1));
        let mut attempts = 0u64;
        let (by_this_node, manifest) = loop {
            attempts += 1;
            let r = tokio::select! {
                r = self.store.commit(step, req.clone(), cancel) => r,
                () = cancel.cancelled() => return Err(cancelled()),
            };
            match r {
                Ok(CommitOutcome::Committed(m)) => break (true, m),
                Ok(CommitOutcome::AlreadyCommitted(m)) => break (false, m),
                Err(checkpoint::Error::Incomplete { reason, .. }) => {
                    let waited = t1.elapsed();
                    if waited >= wait {
                        return Err(SinkError::Incomplete {
                            step,
                            url: self.url().to_string(),
                            commit_wait_ms: self.opts.commit_wait_ms,
                            waited_ms: waited.as_millis() as u64,
                            reason,
                        });
                    }
                    if attempts == 1 {
                        tracing::debug!(step, %reason, "waiting for the other nodes' parts");
                    }
                    // Never sleep past the deadline: one last attempt happens right at it.
                    let nap = pause.min(wait - waited);
                    tokio::select! {
                        () = tokio::time::sleep(nap) => {}
                        () = cancel.cancelled() => return Err(cancelled()),
                    }
                }
                Err(_) if cancel.is_cancelled() => return Err(cancelled()),
                Err(source) => {
                    return Err(SinkError::Commit {
                        step,
                        url: self.url().to_string(),
                        source: Box::new(source),
                    });
                }
            }
        };
        let commit_ms = t1.elapsed().as_millis() as u64;
        if !by_this_node && !written_by_generation(&manifest, s.generation) {
            tracing::warn!(
                step,
                generation = s.generation,
                "step was committed by another generation; this node's upload is unused"
            );
        }
        tracing::info!(
            step,
            bytes,
            upload_ms,
            commit_ms,
            attempts,
            by_this_node,
            "step committed"
        );
        if by_this_node {
            self.retain(step, cancel).await;
        }
        Ok(Committed {
            step,
            bytes,
            by_this_node,
            upload_ms,
            commit_ms,
        })
    }

    /// Retention after `committed`, a commit this node wrote. It runs on every commit, so it
    /// stays cheap: gc's `Present` check (manifests read, objects listed or HEADed, no data
    /// read) of the newest `keep_steps` steps only. A flipped bit goes unseen, which is safe here:
    /// `committed` is pinned (counted as verifying, never deleted), and it is good, since this
    /// agent checksummed its chunks as it uploaded them and the commit found every part
    /// durable. It is normally the newest step; when a newer one that passes the cheap check
    /// is corrupt (an older step was restored past it), the pin still keeps `committed`. A step
    /// that does not pass (a garbled manifest, a missing or truncated object) does not count
    /// toward `keep_steps`. `elastic-ckpt gc` reads the steps it keeps in full.
    pub(super) async fn retain(&self, committed: u64, cancel: &CancellationToken) {
        let policy = RetentionPolicy {
            keep_last: self.opts.keep_steps,
            keep_every: self.opts.keep_every,
            leftover_age_ms_min: LEFTOVER_AGE_MS_MIN,
            check: checkpoint::retention::GcCheck::Present,
            pinned: Some(committed),
        };
        match self.store.gc(&policy, false, cancel).await {
            Ok(r) if r.objects_deleted > 0 => tracing::info!(
                objects = r.objects_deleted,
                bytes = r.bytes_deleted,
                keep_steps = policy.keep_last,
                "retention removed old steps"
            ),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "retention failed (the commit stands)"),
        }
    }
}

pub(super) fn written_by_generation(m: &Manifest, generation: u64) -> bool {
    let prefix = format!("g{generation}-rank-");
    m.parts.iter().all(|p| p.writer.starts_with(&prefix))
}

/// The request's own consistency: ranks unique, inside the world, all of this step.
pub(super) fn check_parts(
    step: u64,
    world_size: u32,
    parts: &[StagedPart],
) -> Result<(), SinkError> {
    let bad = |reason: String| Err(SinkError::InvalidInput(format!("step {step}: {reason}")));
    if world_size == 0 {
        return bad("world size is 0".into());
    }
    if parts.is_empty() {
        return bad("no staged parts".into());
    }
    if parts.len() > world_size as usize {
        return bad(format!("{} parts for a world of {world_size}", parts.len()));
    }
    let mut seen = BTreeSet::new();
    for p in parts {
        if p.step != step {
            return bad(format!("rank {}'s part is of step {}", p.rank, p.step));
        }
        if p.rank >= world_size {
            return bad(format!(
                "rank {} is outside a world of {world_size}",
                p.rank
            ));
        }
        if !seen.insert(p.rank) {
            return bad(format!("rank {} staged twice", p.rank));
        }
    }
    Ok(())
}

/// Checks one staged part (`meta.json` of this step, rank and world; a tensor file) and
/// returns the trainer's JSON state from its `meta.json` (`{}` when it has none).
pub(super) fn read_staged(
    step: u64,
    world_size: u32,
    p: &StagedPart,
) -> Result<serde_json::Value, SinkError> {
    let staged = |path: PathBuf, reason: String| SinkError::Staged {
        step,
        rank: p.rank,
        path,
        reason,
    };
    let tensors = p.dir.join(STAGED_TENSORS);
    if !tensors.is_file() {
        return Err(staged(tensors, "missing".into()));
    }
    let path = p.dir.join(STAGED_META);
    let v = read_json_bounded(&path).map_err(|r| staged(path.clone(), r))?;
    let field = |k: &str| v.get(k).and_then(|x| x.as_u64());
    match field("format_version") {
        Some(v) if v == u64::from(FORMAT_VERSION) => {}
        other => {
            return Err(staged(
                path,
                format!(
                    "unknown snapshot format version {other:?} (this agent reads {FORMAT_VERSION})"
                ),
            ));
        }
    }
    if field("step") != Some(step) {
        return Err(staged(path, format!("is not a snapshot of step {step}")));
    }
    if field("rank") != Some(u64::from(p.rank)) {
        return Err(staged(path, format!("is not rank {}'s snapshot", p.rank)));
    }
    if field("world_size").is_some_and(|w| w != u64::from(world_size)) {
        return Err(staged(
            path,
            format!("was saved for a world other than {world_size}"),
        ));
    }
    let state = v.get("state").cloned().unwrap_or(serde_json::json!({}));
    if !state.is_object() {
        return Err(staged(path, "\"state\" is not a JSON object".into()));
    }
    Ok(state)
}
