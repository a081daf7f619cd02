//! The agent ↔ worker channel: a Unix socket at `$ELASTIC_AGENT_SOCKET`.
//!
//! # Protocol
//!
//! Newline-delimited JSON, UTF-8, one object per line, at most [`MESSAGE_BYTES_MAX`] bytes per
//! line including the newline. A worker connects (one connection per process is enough, and it
//! may stay open for the whole run), sends a request line and reads exactly one reply line
//! before sending the next request. Every object has a `type`.
//!
//! Requests (worker → agent):
//!
//! | request | meaning | reply |
//! |---|---|---|
//! | `{"type":"progress","rank":R,"step":S}` | rank R finished step S (feeds the hang watchdog and metrics) | `ok` |
//! | `{"type":"saved","rank":R,"step":S,"dir":"D"}` | rank R finished writing its snapshot of step S into D, a directory under `$ELASTIC_STAGING_DIR` | `ok` once the agent took it over (held back while four earlier checkpoints are uncommitted), else `error` |
//! | `{"type":"query"}` | what should the workers do? | `state` |
//! | `{"type":"skipped","rank":R,"step":S,"reason":"..."}` | rank R could not write its snapshot of step S (its staging file system is full): the agent gives the step up in the store, so no node waits for the part | `ok` |
//! | `{"type":"peer_stop","rank":R,"step":S}` | the workers agreed to stop at step S because another node's agent asked, not this one (its clean exit is then no end of the job) | `ok` |
//!
//! Replies (agent → worker):
//!
//! - `{"type":"ok"}`
//! - `{"type":"state","should_stop":B,"should_checkpoint_at":S|null,"generation":G}`:
//!   `should_stop` is set while the agent drains (SIGTERM, SIGINT, a preemption notice, or a
//!   new generation on its way); workers then save the step they agree on and exit 0.
//!   `should_checkpoint_at` asks for a snapshot at that step (or the first step past it).
//! - `{"type":"error","message":"..."}`: the request was refused (bad JSON, a rank that is not
//!   this node's, a directory outside staging, an oversized line). After an oversized line
//!   the agent closes the connection, since it cannot find the next message boundary.
//!
//! Unknown fields are ignored, so either side can add fields without breaking the other.
//! Nothing a worker sends can panic the agent; every value is checked before use.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Semaphore, mpsc, watch};

use crate::worker_env::ResumePoint;

/// Longest request or reply line, newline included.
pub const MESSAGE_BYTES_MAX: usize = 64 * 1024;
/// Most worker connections served at once; workers hold one each.
/// While a worker waits to hand over a part, the hang watchdog hears from the agent this often.
const BACKPRESSURE_TICK_MS: u64 = 1_000;
pub const CONNECTIONS_MAX: usize = 4 * crate::cli::NPROC_PER_NODE_MAX as usize;

/// A worker's request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Request {
    Progress {
        rank: u32,
        step: u64,
    },
    Saved {
        rank: u32,
        step: u64,
        dir: String,
    },
    Query {},
    /// Rank `rank` could not write its snapshot of `step` (its staging disk is full).
    Skipped {
        rank: u32,
        step: u64,
        reason: String,
    },
    /// The workers agreed to stop at `step` because another node's agent asked (a peer's
    /// drain), not this one: their clean exit does not mean the job is done.
    PeerStop {
        rank: u32,
        step: u64,
    },
}

/// The agent's reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Reply {
    Ok,
    State {
        should_stop: bool,
        should_checkpoint_at: Option<u64>,
        generation: u64,
    },
    Error {
        message: String,
    },
}

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

/// What the agent tells workers, and what it learned from them. Shared between the socket
/// server, the supervisor (watchdog) and the agent loop. The lock is never held across an
/// await.
#[derive(Debug)]
pub struct AgentState {
    inner: Mutex<Inner>,
    /// The agent's Prometheus metrics.
    pub metrics: crate::metrics::Metrics,
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
    last_progress: Option<Instant>,
    last_step: Option<u64>,
    /// Whether any worker has spoken the protocol in this generation: only such workers can
    /// be drained through the socket, others get SIGTERM at once.
    client_seen: bool,
    /// Canonical staging root; `saved` directories must be inside it.
    staging_root: PathBuf,
    /// The newest committed step, for workers restarted after a failure.
    resume: Option<ResumePoint>,
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
                last_progress: None,
                last_step: None,
                client_seen: false,
                staging_root,
                resume: None,
                refused: None,
            }),
            metrics: crate::metrics::Metrics::default(),
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
            Request::Saved { rank, step, .. } => {
                check_rank(&s.ranks, rank)?;
                if let Some(why) = s.refused.take() {
                    return Err(why);
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

/// Serves the socket until `shutdown` turns true. Saved parts go to `parts`; a full channel
/// makes the worker wait for its `ok` (back-pressure rather than an unbounded queue).
pub async fn serve(
    listener: UnixListener,
    state: Arc<AgentState>,
    parts: mpsc::Sender<Received>,
    shutdown: watch::Receiver<bool>,
) {
    let slots = Arc::new(Semaphore::new(CONNECTIONS_MAX));
    let mut stop = shutdown.clone();
    loop {
        tokio::select! {
            () = stopped(&mut stop) => return,
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((s, _)) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "agent socket accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Ok(permit) = slots.clone().try_acquire_owned() else {
                    tracing::warn!("too many worker connections; refusing one");
                    continue;
                };
                let state = state.clone();
                let parts = parts.clone();
                let shutdown = shutdown.clone();
                tokio::spawn(async move {
                    let _permit = permit;
                    if let Err(e) = serve_connection(stream, &state, &parts, shutdown).await {
                        tracing::debug!(error = %e, "worker connection ended");
                    }
                });
            }
        }
    }
}

async fn serve_connection(
    stream: UnixStream,
    state: &AgentState,
    parts: &mpsc::Sender<Received>,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    let mut line = Vec::with_capacity(256);
    loop {
        line.clear();
        let mut limited = (&mut reader).take(MESSAGE_BYTES_MAX as u64);
        let n = tokio::select! {
            () = stopped(&mut shutdown) => return Ok(()),
            n = limited.read_until(b'\n', &mut line) => n?,
        };
        if n == 0 {
            return Ok(());
        }
        if line.last() != Some(&b'\n') {
            let too_long = line.len() >= MESSAGE_BYTES_MAX;
            let message = if too_long {
                format!("message longer than {MESSAGE_BYTES_MAX} bytes")
            } else {
                "connection closed mid-message".to_string()
            };
            send(&mut write, &Reply::Error { message }).await?;
            return Ok(());
        }
        let reply = match state.handle_line(&line) {
            (reply, None) => reply,
            (reply, Some(part)) => match hand_over_part(state, parts, part).await {
                Ok(()) => reply,
                Err(_) => Reply::Error {
                    message: "agent is shutting down".into(),
                },
            },
        };
        send(&mut write, &reply).await?;
    }
}

/// Queues a saved part for the agent loop. While earlier checkpoints are still being committed
/// the queue is full and the worker waits for its reply: training cannot run more than a
/// bounded number of checkpoints ahead of the store. The wait counts as progress for the hang
/// watchdog (the agent, not the worker, is what holds the step), and as backpressure time.
async fn hand_over_part(
    state: &AgentState,
    parts: &mpsc::Sender<Received>,
    part: Received,
) -> Result<(), mpsc::error::SendError<Received>> {
    let started = Instant::now();
    let send = parts.send(part);
    tokio::pin!(send);
    let mut tick = tokio::time::interval(Duration::from_millis(BACKPRESSURE_TICK_MS));
    tick.tick().await;
    let mut warned = false;
    let r = loop {
        tokio::select! {
            r = &mut send => break r,
            _ = tick.tick() => {
                state.lock().last_progress = Some(Instant::now());
                if !warned {
                    warned = true;
                    tracing::warn!(
                        "earlier checkpoints are still being committed; the worker waits to hand over its part"
                    );
                }
            }
        }
    };
    let waited = started.elapsed();
    if warned {
        tracing::info!(
            waited_ms = waited.as_millis() as u64,
            "checkpoint part handed over after waiting"
        );
    }
    state
        .metrics
        .checkpoint_backpressure_micros_total
        .fetch_add(
            waited.as_micros().min(u128::from(u64::MAX)) as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    r
}

/// Resolves once `shutdown` is true (or its sender is gone).
pub(crate) async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|s| *s).await;
}

async fn send(write: &mut tokio::net::unix::OwnedWriteHalf, reply: &Reply) -> std::io::Result<()> {
    let mut bytes = serde_json::to_vec(reply).map_err(std::io::Error::other)?;
    bytes.push(b'\n');
    debug_assert!(bytes.len() <= MESSAGE_BYTES_MAX);
    write.write_all(&bytes).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncBufReadExt;

    struct Harness {
        _dir: tempfile::TempDir,
        staging: PathBuf,
        socket: PathBuf,
        state: Arc<AgentState>,
        parts: mpsc::Receiver<Received>,
        stop: watch::Sender<bool>,
    }

    async fn harness() -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let staging = dir.path().join("staging");
        std::fs::create_dir_all(&staging).unwrap();
        let staging = std::fs::canonicalize(&staging).unwrap();
        let socket = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let state = Arc::new(AgentState::new(staging.clone()));
        state.begin_group(3, 4, 2..4);
        let (tx, rx) = mpsc::channel(8);
        let (stop, stop_rx) = watch::channel(false);
        tokio::spawn(serve(listener, state.clone(), tx, stop_rx));
        Harness {
            _dir: dir,
            staging,
            socket,
            state,
            parts: rx,
            stop,
        }
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

    #[tokio::test]
    async fn a_full_part_queue_holds_the_worker_and_keeps_the_watchdog_fed() {
        let state = Arc::new(AgentState::new(PathBuf::from("/staging")));
        state.begin_group(1, 1, 0..1);
        let part = |step| Received {
            skipped: None,
            part: StagedPart {
                rank: 0,
                step,
                dir: PathBuf::from(format!("/staging/step-{step}/rank-0")),
            },
            epoch: 1,
            generation: 1,
            ranks: 0..1,
            world_size: 1,
        };
        let (tx, mut rx) = mpsc::channel(1);
        hand_over_part(&state, &tx, part(5)).await.unwrap();
        assert!(
            state.last_progress().is_none(),
            "room: no wait, no progress faked"
        );
        let waiting = tokio::spawn({
            let (state, tx) = (state.clone(), tx.clone());
            async move { hand_over_part(&state, &tx, part(10)).await }
        });
        tokio::time::sleep(Duration::from_millis(2 * BACKPRESSURE_TICK_MS + 200)).await;
        assert!(
            !waiting.is_finished(),
            "the worker waits while the queue is full"
        );
        let fed = state
            .last_progress()
            .expect("the watchdog hears from the agent");
        assert!(fed.elapsed() <= Duration::from_millis(BACKPRESSURE_TICK_MS));
        assert_eq!(rx.recv().await.unwrap().part.step, 5);
        waiting.await.unwrap().unwrap();
        assert_eq!(rx.recv().await.unwrap().part.step, 10);
        let waited_us = state
            .metrics
            .checkpoint_backpressure_micros_total
            .load(std::sync::atomic::Ordering::Relaxed);
        assert!(waited_us >= 2 * BACKPRESSURE_TICK_MS * 1000, "{waited_us}");
    }

    async fn roundtrip(conn: &mut BufReader<UnixStream>, line: &str) -> serde_json::Value {
        conn.get_mut().write_all(line.as_bytes()).await.unwrap();
        let mut out = String::new();
        conn.read_line(&mut out).await.unwrap();
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out:?}: {e}"))
    }

    #[tokio::test]
    async fn query_reports_drain_checkpoint_and_generation() {
        let h = harness().await;
        let mut c = BufReader::new(UnixStream::connect(&h.socket).await.unwrap());
        let r = roundtrip(&mut c, "{\"type\":\"query\"}\n").await;
        assert_eq!(
            r,
            serde_json::json!({"type":"state","should_stop":false,"should_checkpoint_at":null,"generation":3})
        );
        h.state.request_stop();
        h.state.request_checkpoint_at(40);
        let r = roundtrip(&mut c, "{\"type\":\"query\",\"extra\":1}\n").await;
        assert_eq!(
            r,
            serde_json::json!({"type":"state","should_stop":true,"should_checkpoint_at":40,"generation":3})
        );
        assert!(h.state.client_seen());
        let _ = h.stop.send(true);
    }

    #[tokio::test]
    async fn progress_feeds_the_watchdog_and_rejects_foreign_ranks() {
        let h = harness().await;
        let mut c = BufReader::new(UnixStream::connect(&h.socket).await.unwrap());
        assert!(h.state.last_progress().is_none());
        let r = roundtrip(&mut c, "{\"type\":\"progress\",\"rank\":3,\"step\":9}\n").await;
        assert_eq!(r["type"], "ok");
        assert!(h.state.last_progress().is_some());
        assert_eq!(h.state.last_step(), Some(9));
        let r = roundtrip(&mut c, "{\"type\":\"progress\",\"rank\":4,\"step\":10}\n").await;
        assert_eq!(r["type"], "error", "{r}");
        assert_eq!(h.state.last_step(), Some(9));
    }

    #[tokio::test]
    async fn saved_hands_over_dirs_inside_staging_only() {
        let mut h = harness().await;
        let part = h.staging.join("step-5/rank-2");
        std::fs::create_dir_all(&part).unwrap();
        let mut c = BufReader::new(UnixStream::connect(&h.socket).await.unwrap());
        let msg =
            serde_json::json!({"type":"saved","rank":2,"step":5,"dir":part}).to_string() + "\n";
        assert_eq!(roundtrip(&mut c, &msg).await["type"], "ok");
        let got = h.parts.recv().await.unwrap();
        assert_eq!(
            got.part,
            StagedPart {
                rank: 2,
                step: 5,
                dir: part.clone()
            }
        );
        assert_eq!((got.epoch, got.ranks, got.world_size), (1, 2..4, 4));

        let escape = format!("{}/../..", part.display());
        for dir in [
            escape.as_str(),
            "/etc",
            h.staging.to_str().unwrap(),
            "/nonexistent/x",
        ] {
            let msg =
                serde_json::json!({"type":"saved","rank":2,"step":5,"dir":dir}).to_string() + "\n";
            assert_eq!(roundtrip(&mut c, &msg).await["type"], "error", "{dir}");
        }
        assert!(h.parts.try_recv().is_err());
    }

    #[tokio::test]
    async fn garbage_gets_an_error_and_the_connection_keeps_working() {
        let h = harness().await;
        let mut c = BufReader::new(UnixStream::connect(&h.socket).await.unwrap());
        for bad in [
            "not json\n",
            "{\"type\":\"launch\"}\n",
            "{\"type\":\"progress\",\"rank\":-1,\"step\":1}\n",
            // Steps past the largest one the format and etcd records hold.
            "{\"type\":\"progress\",\"rank\":3,\"step\":18446744073709551615}\n",
            "{\"type\":\"peer_stop\",\"rank\":3,\"step\":9007199254740992}\n",
            "[]\n",
            "\n",
        ] {
            assert_eq!(roundtrip(&mut c, bad).await["type"], "error", "{bad:?}");
        }
        assert_eq!(
            roundtrip(&mut c, "{\"type\":\"query\"}\n").await["type"],
            "state"
        );
        assert_eq!(h.state.last_step(), None, "no refused step was recorded");
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

    #[tokio::test]
    async fn a_skipped_snapshot_reaches_the_agent_with_its_reason() {
        let mut h = harness().await;
        let mut c = BufReader::new(UnixStream::connect(&h.socket).await.unwrap());
        let msg = "{\"type\":\"skipped\",\"rank\":3,\"step\":8,\"reason\":\"staging full\"}\n";
        assert_eq!(roundtrip(&mut c, msg).await["type"], "ok");
        let r = h.parts.recv().await.unwrap();
        assert_eq!((r.part.rank, r.part.step), (3, 8));
        assert_eq!(r.skipped.as_deref(), Some("staging full"));
        // A foreign rank is refused like for `saved`.
        let foreign = "{\"type\":\"skipped\",\"rank\":0,\"step\":8,\"reason\":\"x\"}\n";
        assert_eq!(roundtrip(&mut c, foreign).await["type"], "error");
    }

    #[tokio::test]
    async fn a_step_the_store_refused_fails_the_next_save_once_with_the_reason() {
        let h = harness().await;
        let mut c = BufReader::new(UnixStream::connect(&h.socket).await.unwrap());
        let part = h.staging.join("step-5/rank-2");
        std::fs::create_dir_all(&part).unwrap();
        let msg =
            serde_json::json!({"type":"saved","rank":2,"step":5,"dir":part}).to_string() + "\n";
        h.state
            .refuse_next_save("step 4 is refused: its manifest would be too large".into());
        let r = roundtrip(&mut c, &msg).await;
        assert_eq!(r["type"], "error");
        assert!(
            r["message"].as_str().unwrap().contains("step 4 is refused"),
            "{r}"
        );
        assert_eq!(roundtrip(&mut c, &msg).await["type"], "ok");
    }

    #[tokio::test]
    async fn oversized_line_is_refused_and_closes_the_connection() {
        let h = harness().await;
        let mut c = BufReader::new(UnixStream::connect(&h.socket).await.unwrap());
        let big = format!(
            "{{\"type\":\"query\",\"pad\":\"{}\"}}\n",
            "x".repeat(MESSAGE_BYTES_MAX)
        );
        let r = roundtrip(&mut c, &big).await;
        assert_eq!(r["type"], "error");
        assert!(r["message"].as_str().unwrap().contains("longer"));
        let mut rest = String::new();
        // The agent closed its side: EOF (or a reset, since we had unread bytes in flight).
        let n = c.read_line(&mut rest).await.unwrap_or(0);
        assert_eq!(n, 0, "{rest:?}");
        // A new connection works.
        let mut c2 = BufReader::new(UnixStream::connect(&h.socket).await.unwrap());
        assert_eq!(
            roundtrip(&mut c2, "{\"type\":\"query\"}\n").await["type"],
            "state"
        );
    }
}
