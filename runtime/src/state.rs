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

mod in_place;
mod restore;
pub use in_place::InPlaceOffer;
pub use restore::{OnDemandRestore, RestoreFuture};

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
    /// Recovery in place: who watches, the offer, the switch under way.
    in_place: in_place::InPlace,
    /// The restore the workers may ask for: set when the node joined a generation without
    /// restoring its resume step (its continuing members hold it).
    on_demand: Option<std::sync::Arc<dyn OnDemandRestore>>,
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
                in_place: Default::default(),
                on_demand: None,
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
        s.in_place = Default::default();
        drop(s);
        self.in_place_changed();
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

    /// The restore the next worker group may ask for (None: it may not, its step was restored
    /// before it started or it has none).
    pub fn set_on_demand_restore(&self, r: Option<std::sync::Arc<dyn OnDemandRestore>>) {
        let old = std::mem::replace(&mut self.lock().on_demand, r);
        if let Some(old) = old {
            old.cancel();
        }
    }

    /// The restore rank `rank` asks for, of `step`: it must be this node's rank, and the step
    /// the node joined at without restoring it.
    pub fn on_demand_restore(
        &self,
        rank: u32,
        step: u64,
    ) -> Result<std::sync::Arc<dyn OnDemandRestore>, String> {
        let mut s = self.lock();
        check_rank(&s.ranks, rank)?;
        s.client_seen = true;
        let r = s.on_demand.clone().ok_or_else(|| {
            format!("restore of step {step}: this node's workers started with their step restored (or none to restore); there is nothing to restore on demand")
        })?;
        if r.step() != step {
            return Err(format!(
                "restore of step {step}: this node joined at step {}",
                r.step()
            ));
        }
        Ok(r)
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
            Request::Watch { rank, generation } => Ok((s.watch(rank, generation)?, None)),
            Request::Switched { rank, generation } => {
                if s.switched(rank, generation)? {
                    drop(s);
                    self.in_place_changed();
                }
                Ok((Reply::Ok, None))
            }
            Request::CollectiveFailed {
                rank,
                generation,
                reason,
            } => {
                if s.collective_failed(rank, generation, &reason)? {
                    drop(s);
                    self.in_place_changed();
                }
                Ok((Reply::Ok, None))
            }
            // Served by the socket (`agent_socket`), which awaits the restore: never here.
            Request::Restore { step, .. } => {
                Err(format!("restore of step {step}: not served on this path"))
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
