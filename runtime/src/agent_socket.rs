//! The agent ↔ worker channel: a Unix socket at `$ELASTIC_AGENT_SOCKET`, speaking
//! [`worker::protocol`] (newline-delimited JSON requests and replies; the messages, the
//! staged layout and the limits are documented there).
//!
//! The server accepts up to [`CONNECTIONS_MAX`] worker connections, reads one request line at
//! a time (at most [`MESSAGE_BYTES_MAX`] bytes), hands it to [`AgentState::handle_line`] and
//! writes its reply. A `saved` or `skipped` part goes on to the agent loop before the reply is
//! sent, so a full queue holds the worker back (`hand_over_part`). After an oversized line
//! the server replies `error` and closes the connection, since it cannot find the next message
//! boundary.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Semaphore, mpsc, watch};
use worker::protocol::{MESSAGE_BYTES_MAX, Reply, Request, WATCH_HOLD_MS};

use crate::state::{AgentState, Received};

/// While a worker waits for the agent (a part to hand over, a restore), the hang watchdog hears
/// from the agent this often.
const BACKPRESSURE_TICK_MS: u64 = 1_000;
/// What a `restore` request's line holds (its type's value, quoted).
const RESTORE_TYPE: &[u8] = b"\"restore\"";
/// Most worker connections served at once; workers hold one each.
pub const CONNECTIONS_MAX: usize = 4 * crate::cli::NPROC_PER_NODE_MAX as usize;

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
        if let Some(reply) = restore_on_demand(state, &line, &mut shutdown).await {
            send(&mut write, &reply).await?;
            continue;
        }
        // Before the request is handled, so that no change between the two is missed.
        let changes = state.in_place_changes();
        let reply = match state.handle_line(&line) {
            (same @ Reply::Generation { .. }, None) if matches!(&same, Reply::Generation { env, .. } if env.is_empty()) => {
                hold_watch(state, &line, same, changes, &mut shutdown).await
            }
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
                state.note_agent_progress();
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

/// A `restore` request: the node's restore of the step it joined at, run once for all its
/// ranks, awaited here. The wait counts as progress for the hang watchdog (the agent holds the
/// worker). None when `line` is another request.
async fn restore_on_demand(
    state: &AgentState,
    line: &[u8],
    shutdown: &mut watch::Receiver<bool>,
) -> Option<Reply> {
    // Every request passes here: only a line that names the type is parsed twice.
    if !line.windows(RESTORE_TYPE.len()).any(|w| w == RESTORE_TYPE) {
        return None;
    }
    let Ok(Request::Restore { rank, step }) = serde_json::from_slice::<Request>(line) else {
        return None;
    };
    let job = match state.on_demand_restore(rank, step) {
        Ok(job) => job,
        Err(message) => return Some(Reply::Error { message }),
    };
    let restore = job.restore();
    tokio::pin!(restore);
    let mut tick = tokio::time::interval(Duration::from_millis(BACKPRESSURE_TICK_MS));
    let outcome = loop {
        tokio::select! {
            r = &mut restore => break r,
            () = stopped(shutdown) => break Err("agent is shutting down".to_string()),
            _ = tick.tick() => state.note_agent_progress(),
        }
    };
    Some(match outcome {
        Ok(point) => Reply::Restored {
            step: point.step,
            dir: point.dir.to_string_lossy().into_owned(),
        },
        Err(message) => Reply::Error { message },
    })
}

/// A `watch` with nothing new to say is held until an offer is made or withdrawn, a switch
/// completes, the agent shuts down, or [`WATCH_HOLD_MS`] pass; then it is answered as it
/// stands.
async fn hold_watch(
    state: &AgentState,
    line: &[u8],
    same: Reply,
    mut changes: watch::Receiver<u64>,
    shutdown: &mut watch::Receiver<bool>,
) -> Reply {
    let epoch = state.epoch();
    tokio::select! {
        () = stopped(shutdown) => {}
        _ = tokio::time::timeout(Duration::from_millis(WATCH_HOLD_MS), changes.changed()) => {}
    }
    // A new worker group started meanwhile: this watch is a stopped worker's, and must not
    // count for the new group's workers.
    if state.epoch() != epoch {
        return same;
    }
    match state.handle_line(line) {
        (reply, None) => reply,
        // A watch hands over no part; answer as before should that ever change.
        (_, Some(_)) => same,
    }
}

/// Resolves once `shutdown` is true (or its sender is gone).
async fn stopped(shutdown: &mut watch::Receiver<bool>) {
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
    use std::path::PathBuf;

    use super::*;
    use crate::state::StagedPart;

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

    /// A restore that takes `ms` and counts its runs.
    #[derive(Debug)]
    struct SlowRestore {
        ms: u64,
        runs: std::sync::atomic::AtomicU32,
        cancelled: std::sync::atomic::AtomicBool,
        outcome: tokio::sync::OnceCell<Result<crate::worker_env::ResumePoint, String>>,
    }

    impl crate::state::OnDemandRestore for SlowRestore {
        fn step(&self) -> u64 {
            40
        }

        fn restore(&self) -> crate::state::RestoreFuture<'_> {
            Box::pin(async move {
                self.outcome
                    .get_or_init(|| async {
                        self.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(self.ms)).await;
                        Ok(crate::worker_env::ResumePoint {
                            step: 30,
                            dir: "/s/.restore/step-30".into(),
                            bytes_from_store: 4096,
                        })
                    })
                    .await
                    .clone()
            })
        }

        fn cancel(&self) {
            self.cancelled
                .store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn a_restore_runs_once_for_every_rank_that_asks_and_feeds_the_watchdog() {
        let h = harness().await;
        let mut c = BufReader::new(UnixStream::connect(&h.socket).await.unwrap());
        let none = roundtrip(&mut c, "{\"type\":\"restore\",\"rank\":2,\"step\":40}\n").await;
        assert_eq!(
            none["type"], "error",
            "nothing to restore on demand: {none}"
        );
        let job = Arc::new(SlowRestore {
            ms: BACKPRESSURE_TICK_MS + 300,
            runs: Default::default(),
            cancelled: Default::default(),
            outcome: Default::default(),
        });
        h.state.set_on_demand_restore(Some(job.clone()));
        for (line, why) in [
            (
                "{\"type\":\"restore\",\"rank\":2,\"step\":41}\n",
                "joined at step 40",
            ),
            (
                "{\"type\":\"restore\",\"rank\":7,\"step\":40}\n",
                "not one of this node's ranks",
            ),
        ] {
            let r = roundtrip(&mut c, line).await;
            assert_eq!(r["type"], "error", "{r}");
            assert!(r["message"].as_str().unwrap().contains(why), "{r}");
        }
        let mut d = BufReader::new(UnixStream::connect(&h.socket).await.unwrap());
        let (r2, r3) = tokio::join!(
            roundtrip(&mut c, "{\"type\":\"restore\",\"rank\":2,\"step\":40}\n"),
            roundtrip(&mut d, "{\"type\":\"restore\",\"rank\":3,\"step\":40}\n"),
        );
        let want =
            serde_json::json!({"type": "restored", "step": 30, "dir": "/s/.restore/step-30"});
        assert_eq!((&r2, &r3), (&want, &want));
        assert_eq!(job.runs.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert!(
            h.state.last_progress().is_some(),
            "the wait counts as progress"
        );
        assert!(h.state.client_seen());
        // The connection serves other requests after it.
        let q = roundtrip(&mut c, "{\"type\":\"query\"}\n").await;
        assert_eq!(q["type"], "state", "{q}");
        // The next worker group replaces it: a restore still under way ends.
        assert!(!job.cancelled.load(std::sync::atomic::Ordering::SeqCst));
        h.state.set_on_demand_restore(None);
        assert!(job.cancelled.load(std::sync::atomic::Ordering::SeqCst));
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
