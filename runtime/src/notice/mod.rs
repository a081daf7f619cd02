//! Cloud preemption notices: the agent's watch on the instance metadata service, which tells it,
//! as a typed [`Notice`], to drain or to checkpoint now.
//!
//! Each cloud's service is spoken the way it expects (plain HTTP to a link-local address, no
//! proxy, no redirects); `KIND=http://HOST:PORT` asks the same paths of another host, such as a
//! test server:
//!
//! - **AWS** (IMDSv2): `PUT /latest/api/token` with `X-aws-ec2-metadata-token-ttl-seconds`
//!   ([`AWS_TOKEN_TTL_S`], renewed when half of it has passed), then, every poll interval,
//!   `GET /latest/meta-data/spot/instance-action` with `X-aws-ec2-metadata-token`: 404 means no
//!   interruption, 200 `{"action": "terminate"|"stop"|"hibernate", "time": ...}` is a
//!   preemption. Tokenless (IMDSv1) GETs are used only when the token endpoint does not exist
//!   (404 or 405 on the first PUT), never after a 401 or 403. The rebalance recommendation
//!   (`/latest/meta-data/events/recommendations/rebalance`: 404 none, 200 `{"noticeTime": ...}`)
//!   is polled too; `--rebalance-action` makes it a [`Notice::Rebalance`] (save now), a drain,
//!   or nothing.
//! - **GCP**: `GET /computeMetadata/v1/instance/preempted` with `Metadata-Flavor: Google`, once
//!   plainly and then in a loop with `?wait_for_change=true&last_etag=E&timeout_sec=N`
//!   ([`GCP_WAIT_TIMEOUT_MS`]): the request hangs until the value changes, so a preemption (body
//!   `TRUE`) arrives as it happens instead of at the next poll.
//! - **Azure**: `GET /metadata/scheduledevents?api-version=2020-07-01` with `Metadata: true`,
//!   every poll interval: a `Preempt` or `Terminate` event (one that names this VM when
//!   `--azure-vm-name` is given) is a preemption. Its notice carries an [`Approval`]; the agent
//!   calls [`approve`] when its drain is done, which POSTs `{"StartRequests":[{"EventId":...}]}`
//!   to the same URL so the machine goes sooner.
//! - **Generic URL**: every poll interval, any 2xx answer whose body is not empty, `false` or
//!   `FALSE` is a preemption.
//!
//! A 400, 401 or 403 means the agent is misconfigured (a missing header, a refused token,
//! blocked access). It is never read as "no notice": it is logged at error level (the first time,
//! then at most once a minute) and counted in `elastic_preemption_notice_errors_total{kind="auth"}`;
//! transport and protocol errors are counted under their own kinds. Every request has a timeout,
//! and every answer a size limit ([`RESPONSE_BYTES_MAX`]).
//!
//! What an answer means is decided by pure functions of status and body (`aws_instance_action`,
//! `gcp_preempted`, `azure_event`, ...); [`Watch`] does the requests around them.
//!
//! Layout: this file has the public types, [`poll`], [`approve`] and [`Watch`] (and the generic
//! URL); `aws.rs`, `gcp.rs` and `azure.rs` each speak one cloud's service; `http.rs` has the
//! HTTP client and what every protocol reads the same way (refusals, JSON, quotes).

mod aws;
mod azure;
mod gcp;
mod http;

use std::sync::Arc;
use std::time::Duration;

use checkpoint::CancellationToken;
use reqwest::Url;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::cli::{NoticeKind, PreemptionNotice, RebalanceAction};
use crate::metrics::Metrics;
use crate::state::AgentState;
use http::{Bad, Http, not_a_url, quote, request_timeout, status_bad};

/// Largest metadata answer read; a longer one is a protocol error.
pub const RESPONSE_BYTES_MAX: usize = 64 * 1024;
/// Connect plus answer, per request (a GCP wait gets its wait on top).
pub const REQUEST_TIMEOUT_MS: u64 = 2_000;
/// The IMDSv2 token lifetime asked for; a token is renewed when half of it has passed.
pub const AWS_TOKEN_TTL_S: u64 = 300;
/// How long one GCP `wait_for_change` request may hang (its `timeout_sec`) before it is sent
/// again.
pub const GCP_WAIT_TIMEOUT_MS: u64 = 60_000;
/// Errors of one kind are logged at most this often; the rest at debug level.
const ERROR_LOG_INTERVAL_MS: u64 = 60_000;

/// What the watch tells the agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// This machine is going away: drain. An Azure event is approved once the drain is done.
    Preempt {
        why: String,
        approval: Option<Approval>,
    },
    /// The cloud suggests leaving soon (AWS rebalance recommendation under
    /// `--rebalance-action save`): checkpoint now and keep training.
    Rebalance { why: String },
}

/// An Azure scheduled event to approve when the drain is done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Approval {
    pub url: Url,
    pub event_id: String,
}

/// The `kind` label of `elastic_preemption_notice_errors_total`: what [`NoticeError::kind`]
/// gives (defined with the metrics, which count by it).
pub use crate::metrics::NoticeErrorKind as ErrorKind;

/// Why a check of the metadata service gave no answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NoticeError {
    #[error(
        "{url} answered {status} ({body:?}): the metadata service refuses this agent's requests \
         (a missing header or token, a refused token, or blocked access)"
    )]
    Auth {
        url: String,
        status: u16,
        body: String,
    },
    #[error("{url}: {what}")]
    Transport { url: String, what: String },
    #[error("{url}: {what}")]
    Protocol { url: String, what: String },
}

impl NoticeError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            NoticeError::Auth { .. } => ErrorKind::Auth,
            NoticeError::Transport { .. } => ErrorKind::Transport,
            NoticeError::Protocol { .. } => ErrorKind::Protocol,
        }
    }
}

/// How to watch.
#[derive(Debug, Clone)]
pub struct Config {
    pub notice: PreemptionNotice,
    /// Poll interval (AWS, Azure, generic), and the least time between two GCP requests that
    /// came back without waiting.
    pub every: Duration,
    pub rebalance: RebalanceAction,
    /// Azure: only events that name this VM count.
    pub azure_vm_name: Option<String>,
    pub aws_token_ttl_s: u64,
    pub gcp_wait_timeout_ms: u64,
}

impl Config {
    /// `notice` every `every`, with the default rebalance action, lifetimes and waits.
    pub fn new(notice: PreemptionNotice, every: Duration) -> Self {
        Config {
            notice,
            every,
            rebalance: RebalanceAction::Save,
            azure_vm_name: None,
            aws_token_ttl_s: AWS_TOKEN_TTL_S,
            gcp_wait_timeout_ms: GCP_WAIT_TIMEOUT_MS,
        }
    }
}

/// Watches until a preemption is seen, the agent stops listening, or `cancel` is cancelled
/// (dropping a request in flight, a GCP wait included): sends each [`Notice::Rebalance`] and
/// the [`Notice::Preempt`], counts errors in `state`'s metrics.
pub async fn poll(
    cfg: Config,
    state: Arc<AgentState>,
    out: mpsc::Sender<Notice>,
    cancel: CancellationToken,
) {
    tokio::select! {
        biased;
        () = cancel.cancelled() => tracing::debug!("preemption notice watch stopped"),
        () = watch_until_preempted(cfg, state, out) => {}
    }
}

async fn watch_until_preempted(cfg: Config, state: Arc<AgentState>, out: mpsc::Sender<Notice>) {
    let mut watch = match Watch::new(&cfg) {
        Ok(w) => w,
        Err(e) => {
            state.metrics.notice_error(e.kind());
            tracing::error!(error = %e, "cannot watch for preemption notices");
            return;
        }
    };
    let mut log = ErrorLog::default();
    loop {
        let started = Instant::now();
        match watch.round().await {
            Ok(Some(n)) => {
                let last = matches!(n, Notice::Preempt { .. });
                if out.send(n).await.is_err() || last {
                    return;
                }
            }
            Ok(None) => {}
            Err(e) => {
                state.metrics.notice_error(e.kind());
                log.report(&e);
            }
        }
        // At most one round per interval; a round that waited (GCP) goes again at once.
        tokio::time::sleep(cfg.every.saturating_sub(started.elapsed())).await;
    }
}

/// Approves an Azure scheduled event (the drain is done: the machine may go now). Failures are
/// logged and counted; the agent leaves either way.
pub async fn approve(approval: &Approval, metrics: &Metrics) {
    match azure::approve_event(approval).await {
        Ok(()) => tracing::info!(
            event_id = %approval.event_id,
            "approved the Azure scheduled event: the machine may go now"
        ),
        Err(e) => {
            metrics.notice_error(e.kind());
            tracing::error!(event_id = %approval.event_id, error = %e, "cannot approve the Azure scheduled event; the platform will go ahead at its NotBefore time");
        }
    }
}

/// A generic URL: any 2xx whose body is not empty, `false` or `FALSE`.
fn generic_answer(status: u16, body: &str) -> Result<Option<String>, Bad> {
    let b = body.trim();
    match status {
        200..=299 if !b.is_empty() && !b.eq_ignore_ascii_case("false") => {
            Ok(Some(quote(b).to_string()))
        }
        200..=299 => Ok(None),
        400 | 401 | 403 | 500..=599 => Err(status_bad(status)),
        _ => Ok(None),
    }
}

/// One watch: the client and what each cloud's protocol remembers between rounds.
pub struct Watch {
    http: Http,
    source: Source,
}

enum Source {
    /// Boxed: three URLs and a token, the largest by far.
    Aws(Box<aws::Aws>),
    Gcp(gcp::Gcp),
    Azure(azure::Azure),
    Generic(Url),
}

impl Watch {
    pub fn new(cfg: &Config) -> Result<Watch, NoticeError> {
        let source = match cfg.notice.kind {
            NoticeKind::Aws => Source::Aws(Box::new(aws::Aws::new(cfg)?)),
            NoticeKind::Gcp => Source::Gcp(gcp::Gcp::new(cfg)?),
            NoticeKind::Azure => Source::Azure(azure::Azure::new(cfg)?),
            NoticeKind::Generic => {
                let given = cfg.notice.url.as_str();
                Source::Generic(Url::parse(given).map_err(|e| not_a_url(given, e))?)
            }
        };
        let url = match &source {
            Source::Aws(a) => &a.action_url,
            Source::Gcp(g) => &g.url,
            Source::Azure(a) => &a.url,
            Source::Generic(u) => u,
        };
        Ok(Watch {
            http: Http::new(url)?,
            source,
        })
    }

    /// One check: a notice, none, or why there is no answer. A GCP round may hang up to its
    /// wait timeout.
    pub async fn round(&mut self) -> Result<Option<Notice>, NoticeError> {
        match &mut self.source {
            Source::Aws(a) => a.round(&self.http).await,
            Source::Gcp(g) => g.round(&self.http).await,
            Source::Azure(a) => a.round(&self.http).await,
            Source::Generic(url) => {
                let a = self
                    .http
                    .send(self.http.client.get(url.clone()), url, request_timeout())
                    .await?;
                let why = generic_answer(a.status, &a.body).map_err(|b| b.at(url, &a))?;
                Ok(why.map(|b| Notice::Preempt {
                    why: format!("preemption notice from {url}: {b}"),
                    approval: None,
                }))
            }
        }
    }
}

/// Logs errors of each kind at most once per [`ERROR_LOG_INTERVAL_MS`] (auth at error level),
/// the rest at debug level.
#[derive(Debug, Default)]
struct ErrorLog {
    last: [Option<Instant>; ErrorKind::ALL.len()],
    suppressed: [u64; ErrorKind::ALL.len()],
}

impl ErrorLog {
    fn report(&mut self, e: &NoticeError) {
        let kind = e.kind();
        let i = kind.index();
        let due = self.last[i]
            .is_none_or(|t| t.elapsed() >= Duration::from_millis(ERROR_LOG_INTERVAL_MS));
        if !due {
            self.suppressed[i] += 1;
            tracing::debug!(error = %e, kind = kind.label(), "preemption notice check failed");
            return;
        }
        self.last[i] = Some(Instant::now());
        let suppressed = std::mem::take(&mut self.suppressed[i]);
        match kind {
            ErrorKind::Auth => tracing::error!(
                error = %e,
                suppressed,
                "preemption notices cannot be read: fix the metadata service access, or no preemption will be seen"
            ),
            _ => tracing::warn!(
                error = %e,
                kind = kind.label(),
                suppressed,
                "preemption notice check failed"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::aws::{aws_instance_action, aws_rebalance, aws_token};
    use super::azure::azure_event;
    use super::gcp::gcp_preempted;
    use super::http::QUOTE_BYTES_MAX;
    use super::*;
    use services::metadata::{Azure as AzureServer, Gce, Imds};

    pub(super) fn cfg(kind: NoticeKind, url: &str) -> Config {
        Config::new(
            PreemptionNotice {
                kind,
                url: url.to_string(),
            },
            Duration::from_millis(50),
        )
    }

    pub(super) fn watch(c: &Config) -> Watch {
        Watch::new(c).unwrap()
    }

    pub(super) fn is_preempt(n: &Option<Notice>) -> bool {
        matches!(n, Some(Notice::Preempt { .. }))
    }

    #[test]
    fn answers_are_read_by_their_protocol() {
        let un = |s: &str| Err::<Option<String>, Bad>(Bad::Unexpected(s.to_string()));
        assert_eq!(aws_instance_action(404, ""), Ok(None));
        assert!(
            aws_instance_action(200, r#"{"action": "stop", "time": "2026-01-01T00:00:00Z"}"#)
                .unwrap()
                .unwrap()
                .contains("stop at 2026-01-01T00:00:00Z")
        );
        for s in [400, 401, 403] {
            assert_eq!(aws_instance_action(s, ""), Err(Bad::Refused));
            assert_eq!(aws_rebalance(s, ""), Err(Bad::Refused));
            assert_eq!(aws_token(s, ""), Err(Bad::Refused));
            assert_eq!(gcp_preempted(s, ""), Err(Bad::Refused));
            assert_eq!(azure_event(s, "", None), Err(Bad::Refused));
            assert_eq!(generic_answer(s, "x"), Err(Bad::Refused));
        }
        assert_eq!(aws_instance_action(500, ""), un("unexpected status 500"));
        assert!(matches!(
            aws_instance_action(200, "not json"),
            Err(Bad::Unexpected(_))
        ));
        assert!(matches!(
            aws_instance_action(200, "{}"),
            Err(Bad::Unexpected(_))
        ));
        assert_eq!(
            aws_rebalance(200, r#"{"noticeTime": "T"}"#),
            Ok(Some("T".into()))
        );
        assert_eq!(aws_rebalance(404, ""), Ok(None));
        assert_eq!(aws_token(200, " tok\n"), Ok(Some("tok".into())));
        assert_eq!(aws_token(404, ""), Ok(None));
        assert_eq!(aws_token(405, ""), Ok(None));
        assert!(aws_token(200, "").is_err());
        assert!(aws_token(200, "a b").is_err());
        assert_eq!(gcp_preempted(200, "TRUE"), Ok(true));
        assert_eq!(gcp_preempted(200, "FALSE\n"), Ok(false));
        assert!(gcp_preempted(200, "maybe").is_err());
        assert!(gcp_preempted(404, "").is_err());
        assert_eq!(generic_answer(200, " false "), Ok(None));
        assert_eq!(generic_answer(204, ""), Ok(None));
        assert_eq!(generic_answer(404, "gone"), Ok(None));
        assert_eq!(generic_answer(200, "preempt"), Ok(Some("preempt".into())));
        assert!(generic_answer(503, "").is_err());
        let long = "é".repeat(QUOTE_BYTES_MAX);
        assert!(quote(&long).len() <= QUOTE_BYTES_MAX);
    }

    #[tokio::test]
    async fn refusals_are_auth_errors_never_no_notice() {
        // Each kind asked of a service that wants other headers: the real refusals, 400 and
        // 403, and a 401 for a missing token.
        let (imds, gce, az) = (
            Imds::start().unwrap(),
            Gce::start().unwrap(),
            AzureServer::start().unwrap(),
        );
        let gcp_path = "/computeMetadata/v1/instance/preempted";
        let az_path = "/metadata/scheduledevents?api-version=2020-07-01";
        for (kind, url) in [
            (NoticeKind::Gcp, format!("{}{gcp_path}", az.url())),
            (NoticeKind::Azure, format!("{}{az_path}", gce.url())),
            (NoticeKind::Aws, gce.url()),
            (
                NoticeKind::Generic,
                format!("{}{}", imds.url(), "/latest/meta-data/spot/instance-action"),
            ),
        ] {
            let e = watch(&cfg(kind, &url)).round().await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Auth, "{kind:?}: {e}");
        }
        // `poll` counts them and sends nothing.
        let state = Arc::new(AgentState::new("/tmp".into()));
        let (tx, mut rx) = mpsc::channel(1);
        let task = tokio::spawn(poll(
            cfg(NoticeKind::Gcp, &format!("{}{gcp_path}", az.url())),
            state.clone(),
            tx,
            CancellationToken::new(),
        ));
        tokio::time::sleep(Duration::from_millis(300)).await;
        task.abort();
        assert!(rx.try_recv().is_err());
        assert!(state.metrics.notice_errors(ErrorKind::Auth) >= 2);
    }

    #[tokio::test]
    async fn poll_sends_once_when_preempted_and_survives_a_dead_endpoint() {
        let dead = cfg(NoticeKind::Generic, "http://127.0.0.1:1/x");
        let e = watch(&dead).round().await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Transport, "{e}");
        let gce = Gce::start().unwrap();
        gce.set_preempted(true);
        let state = Arc::new(AgentState::new("/tmp".into()));
        let (tx, mut rx) = mpsc::channel(1);
        poll(
            cfg(NoticeKind::Gcp, &gce.url()),
            state.clone(),
            tx,
            CancellationToken::new(),
        )
        .await;
        assert!(is_preempt(&rx.recv().await));
        assert!(rx.recv().await.is_none(), "one notice, then done");
        assert_eq!(gce.requests(), 1);
    }

    #[tokio::test]
    async fn oversized_answers_are_protocol_errors() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let body = "x".repeat(RESPONSE_BYTES_MAX + 1);
                // Chunked, so no Content-Length gives the size away up front.
                let head =
                    "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
                let chunk = format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len());
                let _ = s.write_all(format!("{head}{chunk}").as_bytes()).await;
            }
        });
        let e = watch(&cfg(NoticeKind::Generic, &format!("http://{addr}/x")))
            .round()
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
    }

    #[tokio::test]
    async fn poll_stops_when_cancelled_even_in_the_middle_of_a_wait() {
        let gce = Gce::start().unwrap();
        let mut c = cfg(NoticeKind::Gcp, &gce.url());
        c.gcp_wait_timeout_ms = 20_000;
        let state = Arc::new(AgentState::new("/tmp".into()));
        let (tx, mut rx) = mpsc::channel(1);
        let cancel = CancellationToken::new();
        let task = tokio::spawn(poll(c.clone(), state.clone(), tx, cancel.clone()));
        let t0 = std::time::Instant::now();
        while gce.waits() == 0 {
            assert!(t0.elapsed() < Duration::from_secs(5), "no wait began");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        cancel.cancel();
        tokio::time::timeout(Duration::from_secs(2), task)
            .await
            .expect("poll returns at once when cancelled, wait or not")
            .unwrap();
        assert!(
            rx.recv().await.is_none(),
            "no notice, and the sender is gone"
        );
        // Cancelled before it starts: not one request.
        let before = gce.requests();
        let (tx, _rx) = mpsc::channel(1);
        poll(c, state, tx, cancel).await;
        assert_eq!(gce.requests(), before);
    }
}
