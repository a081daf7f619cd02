//! Restoring a generation's resume step: before the workers start, with retries of trouble
//! that may pass ([`restore_retrying`]), or, for a node that joins members continuing from
//! memory, only if its workers ask ([`HealFromPeers`]): they take the state from those
//! members over the new process group, and the store is read only when no live rank holds
//! the step.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use checkpoint::CancellationToken;
use elastic::record::Generation;
use tokio::sync::OnceCell;

use super::decide::restore_is_retryable;
use crate::events::{Event, Events};
use crate::pipeline::{SinkError, StoreSink};
use crate::state::{OnDemandRestore, RestoreFuture};
use crate::worker_env::ResumePoint;

/// Attempts at restoring a generation's resume step before the agent gives up.
const RESTORE_ATTEMPTS_MAX: u32 = 6;
/// Pause after the first failed restore; doubles per attempt up to the max (31 s in all).
const RESTORE_BACKOFF_INITIAL_MS: u64 = 1_000;
const RESTORE_BACKOFF_MAX_MS: u64 = 8_000;

/// A restore that ended: the step restored and the newer steps skipped (they did not verify).
pub(super) type Restored = (ResumePoint, Vec<u64>);

/// Restores `step` (or the newest older step that verifies) for `ranks` of a `world_size`
/// world, retrying errors that may pass (a full staging disk, a store that is down) up to
/// [`RESTORE_ATTEMPTS_MAX`] attempts. The error comes with the attempts made.
pub(super) async fn restore_retrying(
    sink: &StoreSink,
    step: u64,
    ranks: Range<u32>,
    world_size: u32,
    cancel: &CancellationToken,
) -> Result<Restored, (SinkError, u32)> {
    let mut attempt = 1u32;
    let mut backoff_ms = RESTORE_BACKOFF_INITIAL_MS;
    loop {
        match sink
            .restore_or_older(step, ranks.clone(), world_size, cancel)
            .await
        {
            Ok(r) => return Ok(r),
            Err(e) if restore_is_retryable(&e) && attempt < RESTORE_ATTEMPTS_MAX => {
                tracing::warn!(step, attempt, backoff_ms, error = %e, "restore failed; retrying");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(backoff_ms)) => {}
                    () = cancel.cancelled() => return Err((e, attempt)),
                }
                attempt += 1;
                backoff_ms = (backoff_ms * 2).min(RESTORE_BACKOFF_MAX_MS);
            }
            Err(e) => return Err((e, attempt)),
        }
    }
}

/// Records a restore that ended: the newer committed steps it skipped (they did not verify) as
/// an event, the bytes it read from the store in the metrics.
pub(super) fn note_restored(
    events: &Events,
    metrics: Option<&crate::metrics::Metrics>,
    generation: u64,
    skipped: Vec<u64>,
    point: &ResumePoint,
) {
    if !skipped.is_empty() {
        events.emit(Event::RestoreFellBack {
            generation,
            skipped,
            step: point.step,
        });
    }
    if let Some(m) = metrics {
        m.restore_bytes_total
            .fetch_add(point.bytes_from_store, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The step `node_id` starts its workers at in `g` without restoring it: `resume_step`, when
/// other members of `g` continue from the generation before (their workers may hold the state
/// in memory) and this node either joins fresh or continues with workers that had to be
/// restarted after switching in place (`workers_were_in_place`: its last group's workers
/// watched for generations, or were started to heal from peers). A node whose last workers did not switch in place restores, as
/// its peers' workers likely restart and restore too.
pub(super) fn heal_step(
    g: Option<&Generation>,
    node_id: &str,
    resume_step: Option<u64>,
    workers_were_in_place: bool,
) -> Option<u64> {
    let g = g?;
    let (_, me) = g.member(node_id)?;
    resume_step
        .filter(|_| g.continues_besides(node_id) && (!me.continuing || workers_were_in_place))
}

/// The restore of the step a node joined at, for its workers to ask for (`restore`): run once,
/// by the first rank that asks.
pub(super) struct HealFromPeers {
    pub step: u64,
    pub generation: u64,
    pub ranks: Range<u32>,
    pub world_size: u32,
    pub sink: Arc<StoreSink>,
    pub events: Arc<Events>,
    /// The agent's state, for its metrics (weak: the state holds this restore).
    pub state: std::sync::Weak<crate::state::AgentState>,
    /// A child of the agent's: cancelled with it, or when the worker group is replaced.
    pub cancel: CancellationToken,
    pub outcome: OnceCell<Result<ResumePoint, String>>,
}

impl std::fmt::Debug for HealFromPeers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HealFromPeers")
            .field("step", &self.step)
            .field("generation", &self.generation)
            .field("ranks", &self.ranks)
            .field("world_size", &self.world_size)
            .field("store", &self.sink.url())
            .finish_non_exhaustive()
    }
}

impl OnDemandRestore for HealFromPeers {
    fn step(&self) -> u64 {
        self.step
    }

    fn cancel(&self) {
        self.cancel.cancel();
    }

    fn restore(&self) -> RestoreFuture<'_> {
        Box::pin(async move {
            self.outcome
                .get_or_init(|| async {
                    let t0 = Instant::now();
                    tracing::warn!(
                        step = self.step,
                        "the workers found no live peer holding the step they joined at; restoring it from the store"
                    );
                    match restore_retrying(
                        &self.sink,
                        self.step,
                        self.ranks.clone(),
                        self.world_size,
                        &self.cancel,
                    )
                    .await
                    {
                        Ok((point, skipped)) => {
                            let state = self.state.upgrade();
                            note_restored(
                                &self.events,
                                state.as_ref().map(|s| &s.metrics),
                                self.generation,
                                skipped,
                                &point,
                            );
                            tracing::info!(step = point.step, dir = %point.dir.display(), ms = t0.elapsed().as_millis() as u64, "restored on the workers' request");
                            self.events.emit(Event::RestoredOnDemand {
                                generation: self.generation,
                                step: point.step,
                                bytes: point.bytes_from_store,
                            });
                            Ok(point)
                        }
                        Err((e, attempts)) => Err(format!(
                            "restore step {} from {} ({attempts} attempts): {e:#}",
                            self.step,
                            self.sink.url()
                        )),
                    }
                })
                .await
                .clone()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use elastic::record::{RECORD_VERSION, RankedMember};
    use elastic::scaling::ScalingDecision;

    fn generation(members: &[(&str, bool)]) -> Generation {
        Generation {
            version: RECORD_VERSION,
            number: 4,
            members: members
                .iter()
                .enumerate()
                .map(|(i, (id, continuing))| RankedMember {
                    node_id: (*id).into(),
                    addr: "127.0.0.1".into(),
                    nproc: 2,
                    rank_offset: 2 * i as u32,
                    continuing: *continuing,
                })
                .collect(),
            world_size: 2 * members.len() as u32,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            scaling: ScalingDecision::identity(),
            resume_step: Some(40),
            created_unix_ms: 0,
        }
    }

    #[test]
    fn a_node_heals_from_continuing_peers_when_it_joins_or_its_in_place_workers_restarted() {
        let g = generation(&[("a", true), ("b", true), ("d", false)]);
        let heal = |node, in_place| heal_step(Some(&g), node, Some(40), in_place);
        // d joins a and b, which continue.
        assert_eq!(heal("d", false), Some(40));
        // a continues: it restores, unless its workers switched in place and were restarted.
        assert_eq!(heal("a", false), None);
        assert_eq!(heal("a", true), Some(40));
        // Nothing to heal: no resume step, not a member, no generation, nobody else continues.
        assert_eq!(heal_step(Some(&g), "d", None, false), None);
        assert_eq!(heal("z", true), None);
        assert_eq!(heal_step(None, "d", Some(40), true), None);
        let alone = generation(&[("a", true), ("d", false)]);
        assert_eq!(heal_step(Some(&alone), "a", Some(40), true), None);
        let fresh = generation(&[("a", false), ("b", false)]);
        assert_eq!(heal_step(Some(&fresh), "a", Some(40), true), None);
    }
}
