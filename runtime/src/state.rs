//! The agent's shared state: what it tells the workers (drain, checkpoint requests, the
//! generation) and what it learned from them (progress, saved parts), with the handling of
//! one worker request ([`AgentState::handle_line`]). The socket server
//! ([`crate::agent_socket`]) feeds it lines; the supervisor (watchdog), the committer and the
//! agent loop read and set it; the metrics server reads its gauges ([`crate::metrics::Source`]).
//!
//! Nothing a worker sends can panic the agent; every value is checked before use: a rank must
//! be this node's, a step at most [`worker::protocol::STEP_MAX`], a `saved` directory inside
//! staging.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use worker::protocol::{Reply, Request};

use crate::metrics::{Gauges, Metrics, Source};
use crate::worker_env::ResumePoint;

// The agent bounds steps with the checkpoint format's check: the protocol's bound must be it.
const _: () = assert!(worker::protocol::STEP_MAX == checkpoint::format::STEP_MAX);

/// A snapshot part a worker handed over: rank `rank`'s share of step `step`, in `dir`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagedPart {
    pub rank: u32,
    pub step: u64,
    pub dir: PathBuf,
}

/// A [`StagedPart`] as received, tagged with the worker group it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    pub part: StagedPart,
    /// Set when the rank could not write its snapshot (`part.dir` is then empty): why.
    pub skipped: Option<String>,
    /// Which worker group (generation or restart) was running; see [`AgentState::epoch`].
    pub epoch: u64,
    /// The generation that group ran in.
    pub generation: u64,
    /// This node's ranks in that group.
    pub ranks: Range<u32>,
    pub world_size: u32,
}

/// The most of a worker's reason for a failed collective that the agent keeps.
const COLLECTIVE_FAILURE_REASON_BYTES_MAX: usize = 512;

/// A generation offered to the running workers, to switch to in place (recovery in place).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InPlaceOffer {
    pub generation: u64,
    pub world_size: u32,
    /// This node's global ranks in it.
    pub ranks: Range<u32>,
    /// The environment variables that change with the generation, as a new worker of it
    /// would get them (the `generation` reply's `env`).
    pub env: std::collections::BTreeMap<String, String>,
}

/// What the agent tells workers, and what it learned from them. Shared between the socket
/// server, the supervisor (watchdog) and the agent loop. The lock is never held across an
/// await.
#[derive(Debug)]
pub struct AgentState {
    inner: Mutex<Inner>,
    /// Bumped whenever an in-place offer is made or withdrawn, or the workers finished a
    /// switch: wakes held `watch` requests and the agent loop.
    in_place_changes: tokio::sync::watch::Sender<u64>,
    /// The agent's Prometheus metrics.
    pub metrics: Metrics,
}

#[derive(Debug)]
struct Inner {
    generation: u64,
    /// Counts worker groups started (generations and restarts alike).
    epoch: u64,
    world_size: u32,
    /// Global ranks of this node's workers in the current generation.
    ranks: Range<u32>,
    should_stop: bool,
    should_checkpoint_at: Option<u64>,
    /// The step the workers stopped at for a peer's drain, if they said so.
    peer_stop: Option<u64>,
    /// The step of each rank's last save (a `saved` with `last`): it saves nothing after it.
    last_saves: std::collections::BTreeMap<u32, u64>,
    last_progress: Option<Instant>,
    last_step: Option<u64>,
    /// Whether any worker has spoken the protocol in this generation: only such workers can
    /// be drained through the socket, others get SIGTERM at once.
    client_seen: bool,
    /// Canonical staging root; `saved` directories must be inside it.
    staging_root: PathBuf,
    /// The newest committed step, for workers restarted after a failure.
    resume: Option<ResumePoint>,
    /// Set once the node has left the job: every later `saved` is refused with it.
    left: Option<String>,
    /// Local ranks (index from this group's first rank) that watch for generations to switch
    /// to in place: when all of them do, a new generation is offered instead of a restart.
    watching: std::collections::BTreeSet<u32>,
    /// The generation offered in place, and the local ranks that switched to it.
    offer: Option<InPlaceOffer>,
    switched: std::collections::BTreeSet<u32>,
    /// The highest step reported before the last switch in place completed.
    step_before_switch: Option<u64>,
    /// A collective failure a worker reported for the running generation, not yet acted on.
    collective_failed: Option<(u64, String)>,
    /// Why the store refused a step this node staged (a manifest over the read limit...):
    /// the next `saved` is answered with it, so the worker's save fails with the reason
    /// instead of the refusal staying in the agent's log.
    refused: Option<String>,
}

impl AgentState {
    pub fn new(staging_root: PathBuf) -> Self {
        AgentState {
            inner: Mutex::new(Inner {
                generation: 0,
                epoch: 0,
                world_size: 0,
                ranks: 0..0,
                should_stop: false,
                should_checkpoint_at: None,
                peer_stop: None,
                last_saves: Default::default(),
                last_progress: None,
                last_step: None,
                client_seen: false,
                staging_root,
                resume: None,
                left: None,
                watching: Default::default(),
                offer: None,
                switched: Default::default(),
                step_before_switch: None,
                collective_failed: None,
                refused: None,
            }),
            in_place_changes: tokio::sync::watch::Sender::new(0),
            metrics: Metrics::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding this lock leaves plain data behind; keep serving.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new worker group starts: new generation and ranks, watchdog and drain flags reset.
    pub fn begin_group(&self, generation: u64, world_size: u32, ranks: Range<u32>) {
        let mut s = self.lock();
        s.should_stop = false;
        s.last_step = None;
        s.generation = generation;
        s.epoch += 1;
        s.world_size = world_size;
        s.ranks = ranks;
        s.last_progress = None;
        s.client_seen = false;
        s.should_checkpoint_at = None;
        s.peer_stop = None;
        s.last_saves.clear();
        s.left = None;
        s.watching.clear();
        s.offer = None;
        s.switched.clear();
        s.collective_failed = None;
        drop(s);
        self.in_place_changes.send_modify(|v| *v += 1);
    }

    /// Whether every worker of the running group watches for generations to switch to in
    /// place (and no switch is under way).
    pub fn workers_switch_in_place(&self) -> bool {
        let s = self.lock();
        !s.ranks.is_empty() && s.watching.len() == s.ranks.len() && s.offer.is_none()
    }

    /// Whether any worker of the running group watches for generations to switch to.
    pub fn watching_any(&self) -> bool {
        !self.lock().watching.is_empty()
    }

    /// Offers `offer` to the running workers: their held `watch` requests are answered with
    /// it. A newer offer replaces an older one that not every rank switched to yet.
    pub fn offer_in_place(&self, offer: InPlaceOffer) {
        let mut s = self.lock();
        s.offer = Some(offer);
        s.switched.clear();
        drop(s);
        self.in_place_changes.send_modify(|v| *v += 1);
    }

    /// The offer made, while not every local rank switched to it yet.
    pub fn pending_offer(&self) -> Option<u64> {
        self.lock().offer.as_ref().map(|o| o.generation)
    }

    /// Takes back an offer the workers did not switch to in time (the agent restarts them
    /// instead); returns whether one was pending.
    pub fn withdraw_offer(&self) -> bool {
        let mut s = self.lock();
        let had = s.offer.take().is_some();
        s.switched.clear();
        drop(s);
        self.in_place_changes.send_modify(|v| *v += 1);
        had
    }

    /// A collective failure a worker reported (the generation, and why), once.
    pub fn take_collective_failure(&self) -> Option<(u64, String)> {
        self.lock().collective_failed.take()
    }

    /// The highest step the workers reported before their last switch in place.
    pub fn step_before_switch(&self) -> Option<u64> {
        self.lock().step_before_switch
    }

    /// Resolves when an offer is made or withdrawn, or a switch completes.
    pub fn in_place_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.in_place_changes.subscribe()
    }
    /// The node left the job: every later `saved` is answered with `why`, and nothing more is
    /// handed to the committer.
    pub fn refuse_saves(&self, why: String) {
        self.lock().left = Some(why);
    }

    /// The step every rank of this node's group saved as its last (a drain's agreed step),
    /// once all of them have said so: after it is committed, nothing this node's workers do
    /// can add to the job.
    pub fn last_saved_step(&self) -> Option<u64> {
        let s = self.lock();
        // Only this group's ranks are recorded (checked, and cleared per group): all of them
        // when there are as many.
        if s.ranks.is_empty() || s.last_saves.len() != s.ranks.len() {
            return None;
        }
        s.last_saves.values().copied().max()
    }

    /// The step the workers of this group stopped at for a peer's drain, if they said so.
    pub fn peer_stop(&self) -> Option<u64> {
        self.lock().peer_stop
    }

    /// Ask workers to save and exit.
    pub fn request_stop(&self) {
        self.lock().should_stop = true;
    }

    pub fn should_stop(&self) -> bool {
        self.lock().should_stop
    }

    /// The store refused a staged step for good: the next `saved` of any worker of this
    /// node gets `why` as its error.
    pub fn refuse_next_save(&self, why: String) {
        self.lock().refused = Some(why);
    }

    /// Ask workers for a snapshot at `step`.
    pub fn request_checkpoint_at(&self, step: u64) {
        self.lock().should_checkpoint_at = Some(step);
    }

    pub fn generation(&self) -> u64 {
        self.lock().generation
    }

    /// Workers in the current generation.
    pub fn world_size(&self) -> u32 {
        self.lock().world_size
    }

    /// Which worker group is running: bumped by every [`AgentState::begin_group`].
    pub fn epoch(&self) -> u64 {
        self.lock().epoch
    }

    /// When any worker of the current group last reported progress.
    pub fn last_progress(&self) -> Option<Instant> {
        self.lock().last_progress
    }

    /// The highest step any worker of the current group reported.
    pub fn last_step(&self) -> Option<u64> {
        self.lock().last_step
    }

    /// Records a newly committed step: restarted workers resume from it.
    pub fn set_resume(&self, point: ResumePoint) {
        let mut s = self.lock();
        if s.resume.as_ref().is_none_or(|r| r.step <= point.step) {
            s.resume = Some(point);
        }
    }

    pub fn resume(&self) -> Option<ResumePoint> {
        self.lock().resume.clone()
    }

    /// The agent itself holds the workers' step (a `saved` waiting for room in the commit
    /// queue): tells the hang watchdog they are alive.
    pub(crate) fn note_agent_progress(&self) {
        self.lock().last_progress = Some(Instant::now());
    }

    pub fn client_seen(&self) -> bool {
        self.lock().client_seen
    }

    /// One request line from a worker (outside bytes: any of them), parsed and handled: the
    /// reply, and the part to hand to the agent loop when it was a `saved` or `skipped`.
    /// Never panics; the fuzz target `runtime/fuzz` drives it.
    pub fn handle_line(&self, line: &[u8]) -> (Reply, Option<Received>) {
        match serde_json::from_slice::<Request>(line) {
            Err(e) => (
                Reply::Error {
                    message: format!("bad request: {e}"),
                },
                None,
            ),
            Ok(req) => match self.handle(req) {
                Err(message) => (Reply::Error { message }, None),
                Ok(done) => done,
            },
        }
    }

    fn handle(&self, req: Request) -> Result<(Reply, Option<Received>), String> {
        // File-system checks happen before taking the lock: they may block.
        let staged = match &req {
            Request::Saved { dir, .. } => {
                let root = self.lock().staging_root.clone();
                Some(check_staged_dir(&root, dir)?)
            }
            _ => None,
        };
        if let Request::Progress { step, .. }
        | Request::Saved { step, .. }
        | Request::Skipped { step, .. }
        | Request::PeerStop { step, .. } = &req
        {
            // Steps travel on into etcd records and manifests: bound them once, here.
            checkpoint::format::validate_step(*step)?;
        }
        let mut s = self.lock();
        s.client_seen = true;
        match req {
            Request::Progress { rank, step } => {
                check_rank(&s.ranks, rank)?;
                s.last_progress = Some(Instant::now());
                s.last_step = Some(s.last_step.map_or(step, |l| l.max(step)));
                Ok((Reply::Ok, None))
            }
            Request::Saved {
                rank, step, last, ..
            } => {
                check_rank(&s.ranks, rank)?;
                if let Some(why) = &s.left {
                    return Err(why.clone());
                }
                if let Some(why) = s.refused.take() {
                    return Err(why);
                }
                if last {
                    let l = s.last_saves.entry(rank).or_insert(step);
                    *l = (*l).max(step);
                }
                let dir = staged.ok_or("saved dir unchecked")?;
                let received = Received {
                    part: StagedPart { rank, step, dir },
                    skipped: None,
                    epoch: s.epoch,
                    generation: s.generation,
                    ranks: s.ranks.clone(),
                    world_size: s.world_size,
                };
                Ok((Reply::Ok, Some(received)))
            }
            Request::Skipped { rank, step, reason } => {
                check_rank(&s.ranks, rank)?;
                if let Some(why) = &s.left {
                    return Err(why.clone());
                }
                let received = Received {
                    part: StagedPart {
                        rank,
                        step,
                        dir: PathBuf::new(),
                    },
                    skipped: Some(reason),
                    epoch: s.epoch,
                    generation: s.generation,
                    ranks: s.ranks.clone(),
                    world_size: s.world_size,
                };
                Ok((Reply::Ok, Some(received)))
            }
            Request::PeerStop { rank, step } => {
                check_rank(&s.ranks, rank)?;
                s.peer_stop = Some(s.peer_stop.map_or(step, |p| p.max(step)));
                Ok((Reply::Ok, None))
            }
            Request::Watch { rank, generation } => {
                // The rank is the worker's rank in the generation it says it runs: the offered
                // one once it switched, else the node's current one.
                let range = match &s.offer {
                    Some(o) if o.generation == generation => o.ranks.clone(),
                    _ => s.ranks.clone(),
                };
                check_rank(&range, rank)?;
                let local = rank - range.start;
                s.watching.insert(local);
                Ok((watch_reply(&s, generation, local), None))
            }
            Request::Switched { rank, generation } => {
                if s.generation == generation && s.offer.is_none() {
                    // Said again after the switch completed.
                    check_rank(&s.ranks, rank)?;
                    return Ok((Reply::Ok, None));
                }
                let Some(o) = &s.offer else {
                    return Err(format!(
                        "no switch to generation {generation} was offered (the node runs generation {})",
                        s.generation
                    ));
                };
                if o.generation != generation {
                    return Err(format!(
                        "generation {generation} is not the one offered ({})",
                        o.generation
                    ));
                }
                check_rank(&o.ranks, rank)?;
                let (local, all) = (rank - o.ranks.start, o.ranks.len());
                s.switched.insert(local);
                if s.switched.len() == all {
                    let o = s.offer.take().expect("checked");
                    s.generation = o.generation;
                    s.world_size = o.world_size;
                    s.ranks = o.ranks;
                    // Parts from now on are the new group's: half-reported old steps are
                    // forgotten (they can never be committed).
                    s.epoch += 1;
                    s.switched.clear();
                    s.last_saves.clear();
                    s.peer_stop = None;
                    // The new generation's steps are reported afresh (its first step).
                    s.step_before_switch = s.last_step.take();
                    s.collective_failed = None;
                    s.last_progress = Some(Instant::now());
                    drop(s);
                    self.in_place_changes.send_modify(|v| *v += 1);
                }
                Ok((Reply::Ok, None))
            }
            Request::CollectiveFailed {
                rank,
                generation,
                reason,
            } => {
                check_rank(&s.ranks, rank)?;
                if generation == s.generation && s.collective_failed.is_none() {
                    let mut end = reason.len().min(COLLECTIVE_FAILURE_REASON_BYTES_MAX);
                    while !reason.is_char_boundary(end) {
                        end -= 1;
                    }
                    s.collective_failed =
                        Some((generation, format!("rank {rank}: {}", &reason[..end])));
                    drop(s);
                    self.in_place_changes.send_modify(|v| *v += 1);
                }
                Ok((Reply::Ok, None))
            }
            Request::Query {} => Ok((
                Reply::State {
                    should_stop: s.should_stop,
                    should_checkpoint_at: s.should_checkpoint_at,
                    generation: s.generation,
                },
                None,
            )),
        }
    }
}

/// The answer to a `watch` from local worker `local` running `generation`: the offer when there
/// is one for another generation (with the worker's rank in it), else `generation` itself with
/// no env (nothing new; the socket holds such an answer until something changes or the hold
/// ends).
fn watch_reply(s: &Inner, generation: u64, local: u32) -> Reply {
    match &s.offer {
        Some(o) if o.generation != generation => Reply::Generation {
            generation: o.generation,
            rank_offset: o.ranks.start,
            rank: o.ranks.start + local,
            env: o.env.clone(),
        },
        _ => {
            let start = match &s.offer {
                Some(o) => o.ranks.start,
                None => s.ranks.start,
            };
            Reply::Generation {
                generation,
                rank_offset: start,
                rank: start + local,
                env: Default::default(),
            }
        }
    }
}

fn check_rank(ranks: &Range<u32>, rank: u32) -> Result<(), String> {
    if ranks.contains(&rank) {
        Ok(())
    } else {
        Err(format!(
            "rank {rank} is not one of this node's ranks {ranks:?}"
        ))
    }
}

/// The directory must exist and resolve (symlinks and `..` included) to a place strictly
/// inside the staging root: the agent later copies and deletes what it names.
fn check_staged_dir(root: &Path, dir: &str) -> Result<PathBuf, String> {
    let canon = std::fs::canonicalize(dir).map_err(|e| format!("saved dir {dir:?}: {e}"))?;
    if !canon.is_dir() {
        return Err(format!("saved dir {dir:?} is not a directory"));
    }
    if canon == root || !canon.starts_with(root) {
        return Err(format!(
            "saved dir {dir:?} is outside the staging dir {}",
            root.display()
        ));
    }
    Ok(canon)
}

impl Source for AgentState {
    fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    fn gauges(&self) -> Gauges {
        let s = self.lock();
        Gauges {
            generation: s.generation,
            world_size: s.world_size,
            last_step: s.last_step,
            last_progress: s.last_progress,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generation_is_offered_in_place_once_every_rank_watches_and_taken_when_all_switched() {
        let state = AgentState::new(PathBuf::from("/staging"));
        state.begin_group(2, 4, 2..4);
        let reply = |r: Request| state.handle(r).map(|(reply, _)| reply);
        let progress = |rank, step| Request::Progress { rank, step };
        let nothing_new = |generation, rank_offset, rank| Reply::Generation {
            generation,
            rank_offset,
            rank,
            env: Default::default(),
        };
        // Nothing offered: a watch hears its own generation back.
        assert_eq!(
            reply(Request::Watch {
                rank: 2,
                generation: 2
            }),
            Ok(nothing_new(2, 2, 2))
        );
        assert!(!state.workers_switch_in_place(), "rank 3 does not watch");
        assert!(
            reply(Request::Watch {
                rank: 0,
                generation: 2
            })
            .is_err(),
            "a foreign rank"
        );
        reply(Request::Watch {
            rank: 3,
            generation: 2,
        })
        .unwrap();
        assert!(state.workers_switch_in_place());
        // Generation 3 puts this node's ranks at 0..2 of a world of 2.
        let env: std::collections::BTreeMap<String, String> =
            [("WORLD_SIZE".to_string(), "2".to_string())].into();
        let mut changes = state.in_place_changes();
        state.offer_in_place(InPlaceOffer {
            generation: 3,
            world_size: 2,
            ranks: 0..2,
            env: env.clone(),
        });
        assert!(changes.has_changed().unwrap());
        changes.mark_unchanged();
        assert_eq!(state.pending_offer(), Some(3));
        let offer = Reply::Generation {
            generation: 3,
            rank_offset: 0,
            rank: 1,
            env,
        };
        assert_eq!(
            reply(Request::Watch {
                rank: 3,
                generation: 2
            }),
            Ok(offer.clone())
        );
        // A rank that switched watches with its new rank and hears nothing new.
        assert_eq!(
            reply(Request::Watch {
                rank: 1,
                generation: 3
            }),
            Ok(nothing_new(3, 0, 1))
        );
        assert!(
            reply(Request::Watch {
                rank: 3,
                generation: 3
            })
            .is_err(),
            "rank 3 is not in generation 3"
        );
        assert!(
            reply(Request::Switched {
                rank: 1,
                generation: 4
            })
            .is_err(),
            "not the generation offered"
        );
        assert!(
            reply(Request::Switched {
                rank: 3,
                generation: 3
            })
            .is_err(),
            "a rank outside the offer"
        );
        state.handle(progress(2, 17)).unwrap();
        reply(Request::Switched {
            rank: 0,
            generation: 3,
        })
        .unwrap();
        // Half switched: the node still runs generation 2, and old-rank saves are its own.
        assert_eq!((state.generation(), state.world_size()), (2, 4));
        assert!(!changes.has_changed().unwrap());
        reply(Request::Switched {
            rank: 1,
            generation: 3,
        })
        .unwrap();
        assert!(changes.has_changed().unwrap());
        assert_eq!((state.generation(), state.world_size()), (3, 2));
        assert_eq!(state.pending_offer(), None);
        assert_eq!(state.step_before_switch(), Some(17));
        assert_eq!(
            state.last_step(),
            None,
            "the new generation's first step is still to come"
        );
        assert!(state.handle(progress(2, 18)).is_err(), "old ranks are gone");
        state.handle(progress(1, 18)).unwrap();
        // Said again: fine. A withdrawn offer is no longer answered.
        reply(Request::Switched {
            rank: 1,
            generation: 3,
        })
        .unwrap();
        state.offer_in_place(InPlaceOffer {
            generation: 4,
            world_size: 4,
            ranks: 2..4,
            env: [("WORLD_SIZE".to_string(), "4".to_string())].into(),
        });
        assert!(state.withdraw_offer());
        assert_eq!(
            reply(Request::Watch {
                rank: 0,
                generation: 3
            }),
            Ok(nothing_new(3, 0, 0))
        );
        assert!(
            reply(Request::Switched {
                rank: 2,
                generation: 4
            })
            .is_err()
        );
    }

    #[test]
    fn a_peer_stop_is_kept_for_the_group_and_checked_for_rank() {
        let state = AgentState::new(PathBuf::from("/staging"));
        state.begin_group(2, 4, 2..4);
        assert_eq!(state.peer_stop(), None);
        assert!(
            state
                .handle(Request::PeerStop { rank: 0, step: 9 })
                .is_err()
        );
        assert_eq!(state.peer_stop(), None, "a foreign rank changes nothing");
        state
            .handle(Request::PeerStop { rank: 2, step: 9 })
            .unwrap();
        state
            .handle(Request::PeerStop { rank: 3, step: 7 })
            .unwrap();
        assert_eq!(state.peer_stop(), Some(9));
        state.begin_group(3, 2, 0..1);
        assert_eq!(state.peer_stop(), None, "a new group starts clean");
    }

    /// The drained step is known once every local rank said its save was the last (the
    /// highest such step of each); after the node left, saves are refused with the reason.
    #[test]
    fn the_last_saved_step_needs_every_rank_and_a_node_that_left_takes_no_more_saves() {
        let dir = tempfile::tempdir().unwrap();
        let staging = std::fs::canonicalize(dir.path()).unwrap();
        for s in [5, 6] {
            for r in [2, 3] {
                std::fs::create_dir_all(staging.join(format!("step-{s}/rank-{r}"))).unwrap();
            }
        }
        let state = AgentState::new(staging.clone());
        state.begin_group(3, 4, 2..4);
        let saved = |rank: u32, step: u64, last: bool| Request::Saved {
            rank,
            step,
            dir: staging
                .join(format!("step-{step}/rank-{rank}"))
                .display()
                .to_string(),
            last,
        };
        state.handle(saved(2, 5, false)).unwrap();
        state.handle(saved(3, 5, false)).unwrap();
        assert_eq!(state.last_saved_step(), None, "no last save yet");
        state.handle(saved(2, 6, true)).unwrap();
        assert_eq!(state.last_saved_step(), None, "rank 3 has not said so");
        state.handle(saved(3, 6, true)).unwrap();
        state.handle(saved(3, 5, true)).unwrap();
        assert_eq!(state.last_saved_step(), Some(6), "the highest of each rank");
        state.refuse_saves("left after step 6".into());
        let err = state.handle(saved(2, 6, true)).unwrap_err();
        assert!(err.contains("left after step 6"), "{err}");
        assert!(
            state
                .handle(Request::Skipped {
                    rank: 2,
                    step: 7,
                    reason: "full".into()
                })
                .is_err()
        );
        state.begin_group(4, 2, 0..2);
        assert_eq!(state.last_saved_step(), None, "a new group starts clean");
    }

    #[test]
    fn the_metrics_render_the_gauges_of_the_moment() {
        let state = AgentState::new(PathBuf::from("/staging"));
        state.begin_group(3, 4, 0..2);
        assert_eq!(
            state.gauges(),
            Gauges {
                generation: 3,
                world_size: 4,
                last_step: None,
                last_progress: None,
            }
        );
        let (reply, part) = state.handle_line(br#"{"type":"progress","rank":1,"step":12}"#);
        assert_eq!((reply, part), (Reply::Ok, None));
        let g = state.gauges();
        assert_eq!((g.generation, g.world_size, g.last_step), (3, 4, Some(12)));
        assert_eq!(g.last_progress, state.last_progress());
        assert!(g.last_progress.is_some());
        let text = state.metrics().render(&g);
        for line in [
            "elastic_generation 3",
            "elastic_world_size 4",
            "elastic_worker_step 12",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }

    /// The stable stand-in for the fuzz target: seeded random and mutated request lines never
    /// panic the handler (`ELASTIC_SEED` replays one seed).
    #[test]
    fn random_and_mutated_request_lines_never_panic() {
        let dir = tempfile::tempdir().unwrap();
        let staging = std::fs::canonicalize(dir.path()).unwrap();
        std::fs::create_dir_all(staging.join("step-5/rank-2")).unwrap();
        let state = AgentState::new(staging.clone());
        state.begin_group(3, 4, 2..4);
        let seeds: Vec<u64> = match std::env::var("ELASTIC_SEED") {
            Ok(s) => vec![s.parse().expect("ELASTIC_SEED is a number")],
            Err(_) => (1..=300).collect(),
        };
        let valid = [
            r#"{"type":"progress","rank":2,"step":9}"#.to_string(),
            format!(
                r#"{{"type":"saved","rank":2,"step":5,"dir":"{}"}}"#,
                staging.join("step-5/rank-2").display()
            ),
            r#"{"type":"skipped","rank":3,"step":8,"reason":"full"}"#.to_string(),
            r#"{"type":"peer_stop","rank":3,"step":7}"#.to_string(),
            r#"{"type":"query"}"#.to_string(),
        ];
        for seed in seeds {
            let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut next = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            for base in &valid {
                let mut line = base.clone().into_bytes();
                for _ in 0..(next() % 6) {
                    let i = (next() as usize) % line.len().max(1);
                    match next() % 4 {
                        0 => line[i] = next() as u8,
                        1 => line.insert(i, b"{}[]\",:0123456789-e.\\u"[(next() % 21) as usize]),
                        2 if !line.is_empty() => {
                            line.remove(i);
                        }
                        _ => line.extend_from_slice(b"99999999999999999999"),
                    }
                }
                let _ = state.handle_line(&line);
            }
            let random: Vec<u8> = (0..(next() % 64)).map(|_| next() as u8).collect();
            let _ = state.handle_line(&random);
        }
    }
}
