//! Prometheus metrics for one agent, served at `GET /metrics` on `--metrics-addr`.
//!
//! Names end in `_total`, `_seconds`, `_bytes` or name a plain gauge. Labels are few and fixed
//! (one agent per process): only `elastic_preemption_notice_errors_total` has one, `kind`, with
//! three values.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};

/// Scrapes served at once; more wait in the accept queue.
const CONNECTIONS_MAX: usize = 16;
/// Longest request head read.
const REQUEST_BYTES_MAX: usize = 8 * 1024;
/// A scraper gets this long to send its request.
const REQUEST_TIMEOUT_MS: u64 = 5_000;

/// Counters and gauges, updated lock-free by the agent, the supervisor and the committer.
#[derive(Debug, Default)]
pub struct Metrics {
    pub worker_groups_started_total: AtomicU64,
    pub worker_restarts_total: AtomicU64,
    /// Workers started in a warm standby (`--warm-standby`) rather than a fresh interpreter.
    pub warm_standby_starts_total: AtomicU64,
    pub checkpoints_committed_total: AtomicU64,
    pub checkpoint_failures_total: AtomicU64,
    pub checkpoint_bytes_total: AtomicU64,
    checkpoint_commit_micros_total: AtomicU64,
    /// Time workers spent waiting in `saved` because earlier checkpoints were not committed.
    pub checkpoint_backpressure_micros_total: AtomicU64,
    /// Bytes read from the checkpoint store by restores (before the workers start, or on their
    /// request).
    pub restore_bytes_total: AtomicU64,
    /// Step + 1 of the newest commit; 0 = none yet.
    committed_step_plus_one: AtomicU64,
    pub drains_total: AtomicU64,
    /// Generations this node ran workers in.
    pub generations_total: AtomicU64,
    /// Times this node lost (or could not renew) its etcd lease.
    pub fences_total: AtomicU64,
    /// 1 while this node holds a live etcd lease, 0 while it does not; absent outside etcd mode.
    pub lease_healthy: AtomicU64,
    /// Whether `lease_healthy` means anything (etcd mode).
    pub has_lease: std::sync::atomic::AtomicBool,
    /// Failed preemption-notice checks, by [`NoticeErrorKind::index`].
    notice_errors_total: [AtomicU64; NoticeErrorKind::ALL.len()],
}

/// The `kind` label of `elastic_preemption_notice_errors_total` (`notice::ErrorKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoticeErrorKind {
    /// 400, 401 or 403: the service refuses this agent's requests.
    Auth,
    /// No answer: connection refused, timeout, reset.
    Transport,
    /// An answer the protocol does not allow: other statuses, bad JSON, oversized.
    Protocol,
}

impl NoticeErrorKind {
    pub const ALL: [NoticeErrorKind; 3] = [
        NoticeErrorKind::Auth,
        NoticeErrorKind::Transport,
        NoticeErrorKind::Protocol,
    ];

    pub fn label(self) -> &'static str {
        match self {
            NoticeErrorKind::Auth => "auth",
            NoticeErrorKind::Transport => "transport",
            NoticeErrorKind::Protocol => "protocol",
        }
    }

    /// Position in [`NoticeErrorKind::ALL`].
    pub fn index(self) -> usize {
        match self {
            NoticeErrorKind::Auth => 0,
            NoticeErrorKind::Transport => 1,
            NoticeErrorKind::Protocol => 2,
        }
    }
}

/// The gauges that live outside [`Metrics`] (in the agent's state), handed to
/// [`Metrics::render`] as values.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Gauges {
    /// Current generation number.
    pub generation: u64,
    /// Workers in the current generation.
    pub world_size: u32,
    /// The highest step any worker of the current group reported.
    pub last_step: Option<u64>,
    /// When any worker of the current group last reported progress.
    pub last_progress: Option<Instant>,
}

/// What [`serve`] renders from: the counters, and the gauges of the moment.
pub trait Source: Send + Sync + 'static {
    fn metrics(&self) -> &Metrics;
    fn gauges(&self) -> Gauges;
}

impl Metrics {
    /// Records one successful commit.
    pub fn committed(&self, step: u64, bytes: u64, took: Duration) {
        self.checkpoints_committed_total
            .fetch_add(1, Ordering::Relaxed);
        self.checkpoint_bytes_total
            .fetch_add(bytes, Ordering::Relaxed);
        self.checkpoint_commit_micros_total.fetch_add(
            took.as_micros().min(u128::from(u64::MAX)) as u64,
            Ordering::Relaxed,
        );
        self.committed_step_plus_one
            .fetch_max(step.saturating_add(1), Ordering::Relaxed);
    }

    /// Counts one failed preemption-notice check.
    pub fn notice_error(&self, kind: NoticeErrorKind) {
        self.notice_errors_total[kind.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Failed preemption-notice checks of one kind so far.
    pub fn notice_errors(&self, kind: NoticeErrorKind) -> u64 {
        self.notice_errors_total[kind.index()].load(Ordering::Relaxed)
    }

    /// The Prometheus text exposition of every metric: these counters, and `gauges`.
    pub fn render(&self, gauges: &Gauges) -> String {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut out = String::with_capacity(2048);
        let mut metric = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        };
        metric(
            "elastic_generation",
            "gauge",
            "Current generation number.",
            gauges.generation.to_string(),
        );
        metric(
            "elastic_world_size",
            "gauge",
            "Workers in the current generation.",
            gauges.world_size.to_string(),
        );
        metric(
            "elastic_worker_groups_started_total",
            "counter",
            "Worker groups started (generations and restarts).",
            get(&self.worker_groups_started_total).to_string(),
        );
        metric(
            "elastic_warm_standby_starts_total",
            "counter",
            "Workers started in a warm standby interpreter (--warm-standby).",
            get(&self.warm_standby_starts_total).to_string(),
        );
        metric(
            "elastic_worker_restarts_total",
            "counter",
            "Worker group restarts after a failure or hang.",
            get(&self.worker_restarts_total).to_string(),
        );
        metric(
            "elastic_checkpoints_committed_total",
            "counter",
            "Checkpoint steps committed by this agent.",
            get(&self.checkpoints_committed_total).to_string(),
        );
        metric(
            "elastic_checkpoint_failures_total",
            "counter",
            "Checkpoint commits that failed.",
            get(&self.checkpoint_failures_total).to_string(),
        );
        metric(
            "elastic_checkpoint_bytes_total",
            "counter",
            "Bytes of committed checkpoints.",
            get(&self.checkpoint_bytes_total).to_string(),
        );
        metric(
            "elastic_restore_bytes_total",
            "counter",
            "Bytes read from the checkpoint store by restores.",
            get(&self.restore_bytes_total).to_string(),
        );
        metric(
            "elastic_checkpoint_backpressure_seconds_total",
            "counter",
            "Time workers waited to hand over a checkpoint while earlier ones were still being committed.",
            format!(
                "{:.6}",
                get(&self.checkpoint_backpressure_micros_total) as f64 / 1e6
            ),
        );
        metric(
            "elastic_checkpoint_commit_seconds_total",
            "counter",
            "Time spent committing checkpoints.",
            format!(
                "{:.6}",
                get(&self.checkpoint_commit_micros_total) as f64 / 1e6
            ),
        );
        metric(
            "elastic_drains_total",
            "counter",
            "Drains started (signal or notice).",
            get(&self.drains_total).to_string(),
        );
        metric(
            "elastic_generations_total",
            "counter",
            "Generations this node ran workers in.",
            get(&self.generations_total).to_string(),
        );
        if self.has_lease.load(Ordering::Relaxed) {
            metric(
                "elastic_lease_healthy",
                "gauge",
                "1 while this node holds a live etcd lease.",
                get(&self.lease_healthy).to_string(),
            );
            metric(
                "elastic_fences_total",
                "counter",
                "Times this node lost or could not renew its etcd lease.",
                get(&self.fences_total).to_string(),
            );
        }
        let committed = get(&self.committed_step_plus_one).checked_sub(1);
        let reported = gauges.last_step;
        if let Some(c) = committed {
            metric(
                "elastic_checkpoint_committed_step",
                "gauge",
                "Newest committed step.",
                c.to_string(),
            );
        }
        if let Some(r) = reported {
            metric(
                "elastic_worker_step",
                "gauge",
                "Highest step reported by a worker.",
                r.to_string(),
            );
            metric(
                "elastic_checkpoint_lag_steps",
                "gauge",
                "Reported step minus newest committed step.",
                r.saturating_sub(committed.unwrap_or(0)).to_string(),
            );
        }
        if let Some(t) = gauges.last_progress {
            metric(
                "elastic_worker_progress_age_seconds",
                "gauge",
                "Seconds since a worker last reported progress.",
                format!("{:.3}", t.elapsed().as_secs_f64()),
            );
        }
        let name = "elastic_preemption_notice_errors_total";
        let _ = writeln!(
            out,
            "# HELP {name} Preemption-notice checks that got no answer, by kind (auth: 400, 401 or 403 from the metadata service, a misconfiguration).\n# TYPE {name} counter"
        );
        for kind in NoticeErrorKind::ALL {
            let _ = writeln!(
                out,
                "{name}{{kind=\"{}\"}} {}",
                kind.label(),
                self.notice_errors(kind)
            );
        }
        out
    }
}

/// Serves `GET /metrics`, rendered from `state`, until `shutdown` turns true (or its sender
/// is gone).
pub async fn serve<S: Source>(
    listener: TcpListener,
    state: Arc<S>,
    mut shutdown: watch::Receiver<bool>,
) {
    let slots = Arc::new(Semaphore::new(CONNECTIONS_MAX));
    loop {
        let accepted = tokio::select! {
            _ = shutdown.wait_for(|s| *s) => return,
            a = listener.accept() => a,
        };
        let Ok((mut stream, _)) = accepted else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let state = state.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let mut head = Vec::with_capacity(512);
            let read = async {
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < REQUEST_BYTES_MAX {
                    let n = stream.read(&mut buf).await?;
                    if n == 0 {
                        break;
                    }
                    head.extend_from_slice(&buf[..n]);
                }
                Ok::<_, std::io::Error>(())
            };
            if !matches!(
                tokio::time::timeout(Duration::from_millis(REQUEST_TIMEOUT_MS), read).await,
                Ok(Ok(()))
            ) {
                return;
            }
            let response = if head.starts_with(b"GET /metrics ")
                || head.starts_with(b"GET /metrics?")
            {
                let body = state.metrics().render(&state.gauges());
                format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                )
            } else {
                "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    .to_string()
            };
            let _ = stream.write_all(response.as_bytes()).await;
            let _ = stream.shutdown().await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_has_help_type_and_values() {
        let metrics = Metrics::default();
        let gauges = Gauges {
            generation: 3,
            world_size: 4,
            ..Gauges::default()
        };
        metrics.committed(40, 1000, Duration::from_millis(1500));
        metrics.committed(50, 24, Duration::from_millis(500));
        metrics.notice_error(NoticeErrorKind::Auth);
        let text = metrics.render(&gauges);
        for line in [
            "elastic_generation 3",
            "elastic_world_size 4",
            "elastic_checkpoints_committed_total 2",
            "elastic_checkpoint_bytes_total 1024",
            "elastic_checkpoint_commit_seconds_total 2.000000",
            "elastic_checkpoint_committed_step 50",
            "# TYPE elastic_worker_restarts_total counter",
            "# TYPE elastic_preemption_notice_errors_total counter",
            "elastic_preemption_notice_errors_total{kind=\"auth\"} 1",
            "elastic_preemption_notice_errors_total{kind=\"transport\"} 0",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert!(
            !text.contains("elastic_worker_step"),
            "no step reported yet"
        );
        assert!(!text.contains("elastic_worker_progress_age_seconds"));
    }

    #[test]
    fn reported_steps_give_the_lag_behind_the_newest_commit() {
        let metrics = Metrics::default();
        metrics.committed(40, 1, Duration::ZERO);
        let gauges = Gauges {
            last_step: Some(47),
            last_progress: Some(Instant::now()),
            ..Gauges::default()
        };
        let text = metrics.render(&gauges);
        for line in ["elastic_worker_step 47", "elastic_checkpoint_lag_steps 7"] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert!(
            text.lines()
                .any(|l| l.starts_with("elastic_worker_progress_age_seconds 0.")),
            "{text}"
        );
    }

    /// A source of fixed gauges.
    #[derive(Default)]
    struct Fixed(Metrics);

    impl Source for Fixed {
        fn metrics(&self) -> &Metrics {
            &self.0
        }
        fn gauges(&self) -> Gauges {
            Gauges::default()
        }
    }

    #[tokio::test]
    async fn serves_metrics_and_404s_other_paths() {
        let state = Arc::new(Fixed::default());
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (_stop, rx) = watch::channel(false);
        tokio::spawn(serve(l, state, rx));
        for (path, want) in [("/metrics", "200 OK"), ("/", "404")] {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
                .await
                .unwrap();
            let mut resp = String::new();
            s.read_to_string(&mut resp).await.unwrap();
            assert!(
                resp.starts_with(&format!("HTTP/1.1 {want}")),
                "{path}: {resp}"
            );
            if want == "200 OK" {
                assert!(resp.contains("elastic_generation 0"), "{resp}");
            }
        }
    }
}
