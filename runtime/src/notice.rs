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

use std::sync::Arc;
use std::time::Duration;

use reqwest::header::{CONTENT_TYPE, ETAG};
use reqwest::{Client, Url};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::cli::{
    AWS_NOTICE_URL, AZURE_NOTICE_URL, GCP_NOTICE_URL, NoticeKind, PreemptionNotice, RebalanceAction,
};
use crate::metrics::Metrics;
use crate::state::AgentState;

/// The `kind` label of `elastic_preemption_notice_errors_total`: what [`NoticeError::kind`]
/// gives (defined with the metrics, which count by it).
pub use crate::metrics::NoticeErrorKind as ErrorKind;

/// Largest metadata answer read; a longer one is a protocol error.
pub const RESPONSE_BYTES_MAX: usize = 64 * 1024;
/// Connect plus answer, per request (a GCP wait gets its wait on top).
pub const REQUEST_TIMEOUT_MS: u64 = 2_000;
/// Connecting alone (the service is link-local: it answers at once or not at all).
const CONNECT_TIMEOUT_MS: u64 = 1_000;
/// The IMDSv2 token lifetime asked for; a token is renewed when half of it has passed.
pub const AWS_TOKEN_TTL_S: u64 = 300;
/// IMDS's shortest and longest token lifetimes (the shortest is ours: a renewal per second).
const AWS_TOKEN_TTL_S_MIN: u64 = 2;
const AWS_TOKEN_TTL_S_MAX: u64 = 21_600;
/// Longest IMDSv2 token accepted.
const AWS_TOKEN_BYTES_MAX: usize = 1_024;
/// How long one GCP `wait_for_change` request may hang (its `timeout_sec`) before it is sent
/// again.
pub const GCP_WAIT_TIMEOUT_MS: u64 = 60_000;
/// Errors of one kind are logged at most this often; the rest at debug level.
const ERROR_LOG_INTERVAL_MS: u64 = 60_000;
/// Longest piece of an answer quoted in a reason or an error.
const QUOTE_BYTES_MAX: usize = 200;

const AWS_TOKEN_PATH: &str = "/latest/api/token";
const AWS_REBALANCE_PATH: &str = "/latest/meta-data/events/recommendations/rebalance";
const AWS_TOKEN_TTL_HEADER: &str = "X-aws-ec2-metadata-token-ttl-seconds";
const AWS_TOKEN_HEADER: &str = "X-aws-ec2-metadata-token";

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

/// Watches until a preemption is seen (or the agent stops listening): sends each
/// [`Notice::Rebalance`] and the [`Notice::Preempt`], counts errors in `state`'s metrics.
pub async fn poll(cfg: Config, state: Arc<AgentState>, out: mpsc::Sender<Notice>) {
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
    match approve_event(approval).await {
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

async fn approve_event(approval: &Approval) -> Result<(), NoticeError> {
    let http = Http::new(&approval.url)?;
    let body = serde_json::json!({"StartRequests": [{"EventId": approval.event_id}]}).to_string();
    let req = http
        .client
        .post(approval.url.clone())
        .header("Metadata", "true")
        .header(CONTENT_TYPE, "application/json")
        .body(body);
    let a = http.send(req, &approval.url, request_timeout()).await?;
    match a.status {
        200..=299 => Ok(()),
        s => Err(status_bad(s).at(&approval.url, &a)),
    }
}

// ---- what an answer means ------------------------------------------------------------------------

/// An answer that is not a notice and not "no notice".
#[derive(Debug, Clone, PartialEq, Eq)]
enum Bad {
    /// 400, 401, 403.
    Refused,
    Unexpected(String),
}

impl Bad {
    fn at(self, url: &Url, a: &Answer) -> NoticeError {
        match self {
            Bad::Refused => NoticeError::Auth {
                url: url.to_string(),
                status: a.status,
                body: quote(&a.body).to_string(),
            },
            Bad::Unexpected(what) => NoticeError::Protocol {
                url: url.to_string(),
                what,
            },
        }
    }
}

fn status_bad(status: u16) -> Bad {
    match status {
        400 | 401 | 403 => Bad::Refused,
        s => Bad::Unexpected(format!("unexpected status {s}")),
    }
}

fn json(body: &str, what: &str) -> Result<Value, Bad> {
    serde_json::from_str(body)
        .map_err(|e| Bad::Unexpected(format!("{what} is not JSON ({e}): {:?}", quote(body))))
}

/// The IMDSv2 token PUT: `Some(token)`, or `None` when there is no token endpoint.
fn aws_token(status: u16, body: &str) -> Result<Option<String>, Bad> {
    match status {
        200 => {
            let t = body.trim();
            if t.is_empty()
                || t.len() > AWS_TOKEN_BYTES_MAX
                || !t.bytes().all(|b| b.is_ascii_graphic())
            {
                return Err(Bad::Unexpected(format!(
                    "not an IMDSv2 token: {} bytes",
                    t.len()
                )));
            }
            Ok(Some(t.to_string()))
        }
        404 | 405 => Ok(None),
        s => Err(status_bad(s)),
    }
}

/// Spot `instance-action`: the reason when an interruption is scheduled.
fn aws_instance_action(status: u16, body: &str) -> Result<Option<String>, Bad> {
    match status {
        404 => Ok(None),
        200 => {
            let v = json(body, "instance-action")?;
            let action = v
                .get("action")
                .and_then(Value::as_str)
                .ok_or_else(|| Bad::Unexpected(format!("no action in {:?}", quote(body))))?;
            let time = v.get("time").and_then(Value::as_str).unwrap_or("unknown");
            // `terminate`, `stop` and `hibernate` all take the machine away; so would a new one.
            Ok(Some(format!(
                "AWS spot interruption: {} at {}",
                quote(action),
                quote(time)
            )))
        }
        s => Err(status_bad(s)),
    }
}

/// The rebalance recommendation: its `noticeTime` when there is one.
fn aws_rebalance(status: u16, body: &str) -> Result<Option<String>, Bad> {
    match status {
        404 => Ok(None),
        200 => {
            let v = json(body, "rebalance recommendation")?;
            let t = v
                .get("noticeTime")
                .and_then(Value::as_str)
                .ok_or_else(|| Bad::Unexpected(format!("no noticeTime in {:?}", quote(body))))?;
            Ok(Some(quote(t).to_string()))
        }
        s => Err(status_bad(s)),
    }
}

/// GCP `preempted`: `TRUE` or `FALSE`.
fn gcp_preempted(status: u16, body: &str) -> Result<bool, Bad> {
    match (status, body.trim()) {
        (200, b) if b.eq_ignore_ascii_case("true") => Ok(true),
        (200, b) if b.eq_ignore_ascii_case("false") => Ok(false),
        (200, b) => Err(Bad::Unexpected(format!("preempted is {:?}", quote(b)))),
        (s, _) => Err(status_bad(s)),
    }
}

/// An Azure event that takes this VM away.
#[derive(Debug, Clone, PartialEq, Eq)]
struct AzureEvent {
    id: String,
    event_type: String,
    not_before: String,
}

/// Azure scheduled events: the first `Preempt` or `Terminate` event for `vm` (any VM when
/// `None`).
fn azure_event(status: u16, body: &str, vm: Option<&str>) -> Result<Option<AzureEvent>, Bad> {
    if status != 200 {
        return Err(status_bad(status));
    }
    let v = json(body, "scheduled events")?;
    let events = v
        .get("Events")
        .and_then(Value::as_array)
        .ok_or_else(|| Bad::Unexpected(format!("no Events in {:?}", quote(body))))?;
    let str_of = |e: &Value, k: &str| e.get(k).and_then(Value::as_str).map(str::to_string);
    for e in events {
        let Some(event_type) = str_of(e, "EventType") else {
            continue;
        };
        if event_type != "Preempt" && event_type != "Terminate" {
            continue;
        }
        let names_vm = |vm: &str| {
            e.get("Resources")
                .and_then(Value::as_array)
                .is_some_and(|rs| {
                    rs.iter()
                        .filter_map(Value::as_str)
                        .any(|r| r.eq_ignore_ascii_case(vm))
                })
        };
        if vm.is_some_and(|vm| !names_vm(vm)) {
            continue;
        }
        let id = str_of(e, "EventId")
            .filter(|id| !id.is_empty())
            .ok_or_else(|| Bad::Unexpected(format!("{event_type} event without an EventId")))?;
        return Ok(Some(AzureEvent {
            id: quote(&id).to_string(),
            event_type,
            not_before: str_of(e, "NotBefore").unwrap_or_default(),
        }));
    }
    Ok(None)
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

/// At most [`QUOTE_BYTES_MAX`] bytes of `s`, cut at a character boundary.
fn quote(s: &str) -> &str {
    let mut end = s.len().min(QUOTE_BYTES_MAX);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

// ---- requests ----------------------------------------------------------------------------------

fn request_timeout() -> Duration {
    Duration::from_millis(REQUEST_TIMEOUT_MS)
}

struct Http {
    client: Client,
}

/// A status, the `ETag`, and at most [`RESPONSE_BYTES_MAX`] bytes of body.
struct Answer {
    status: u16,
    etag: Option<String>,
    body: String,
}

impl Http {
    fn new(url: &Url) -> Result<Http, NoticeError> {
        // Metadata services are link-local: a proxy from the environment must not see these
        // requests (IMDS refuses forwarded ones), and they never redirect.
        let client = Client::builder()
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS))
            .http1_only()
            .build()
            .map_err(|e| NoticeError::Transport {
                url: url.to_string(),
                what: format!("cannot build an HTTP client: {}", chain(&e)),
            })?;
        Ok(Http { client })
    }

    async fn send(
        &self,
        req: reqwest::RequestBuilder,
        url: &Url,
        timeout: Duration,
    ) -> Result<Answer, NoticeError> {
        let transport = |e: reqwest::Error| NoticeError::Transport {
            url: url.to_string(),
            what: if e.is_timeout() {
                format!("no answer within {} ms", timeout.as_millis())
            } else {
                chain(&e)
            },
        };
        let too_big = |n: u64| NoticeError::Protocol {
            url: url.to_string(),
            what: format!("an answer of {n} bytes or more, over {RESPONSE_BYTES_MAX}"),
        };
        let mut resp = req.timeout(timeout).send().await.map_err(transport)?;
        if let Some(n) = resp.content_length()
            && n > RESPONSE_BYTES_MAX as u64
        {
            return Err(too_big(n));
        }
        let status = resp.status().as_u16();
        let etag = resp
            .headers()
            .get(ETAG)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(transport)? {
            if body.len() + chunk.len() > RESPONSE_BYTES_MAX {
                return Err(too_big((body.len() + chunk.len()) as u64));
            }
            body.extend_from_slice(&chunk);
        }
        debug_assert!(body.len() <= RESPONSE_BYTES_MAX);
        Ok(Answer {
            status,
            etag,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    }
}

/// An error and its causes, `a: b: c` (reqwest's own message names only the request).
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

/// The URL to ask: the one given, or the kind's own path and query on the given host when only
/// a host was given (`aws=http://127.0.0.1:PORT`).
fn endpoint(given: &str, default: &str) -> Result<Url, NoticeError> {
    let mut url = Url::parse(given).map_err(|e| not_a_url(given, e))?;
    if url.path() == "/" && url.query().is_none() {
        let d = Url::parse(default).map_err(|e| not_a_url(default, e))?;
        url.set_path(d.path());
        url.set_query(d.query());
    }
    Ok(url)
}

fn not_a_url(url: &str, e: impl std::fmt::Display) -> NoticeError {
    NoticeError::Protocol {
        url: url.to_string(),
        what: format!("not a URL: {e}"),
    }
}

/// One watch: the client and what each cloud's protocol remembers between rounds.
pub struct Watch {
    http: Http,
    source: Source,
}

enum Source {
    /// Boxed: three URLs and a token, the largest by far.
    Aws(Box<Aws>),
    Gcp(Gcp),
    Azure(Azure),
    Generic(Url),
}

impl Watch {
    pub fn new(cfg: &Config) -> Result<Watch, NoticeError> {
        let given = cfg.notice.url.as_str();
        let source = match cfg.notice.kind {
            NoticeKind::Aws => {
                let action = endpoint(given, AWS_NOTICE_URL)?;
                let join = |path: &str| {
                    action.join(path).map_err(|e| NoticeError::Protocol {
                        url: action.to_string(),
                        what: format!("cannot make {path} on it: {e}"),
                    })
                };
                Source::Aws(Box::new(Aws {
                    token_url: join(AWS_TOKEN_PATH)?,
                    rebalance_url: match cfg.rebalance {
                        RebalanceAction::Ignore => None,
                        _ => Some(join(AWS_REBALANCE_PATH)?),
                    },
                    rebalance_drains: cfg.rebalance == RebalanceAction::Drain,
                    action_url: action,
                    ttl_s: cfg
                        .aws_token_ttl_s
                        .clamp(AWS_TOKEN_TTL_S_MIN, AWS_TOKEN_TTL_S_MAX),
                    token: None,
                    had_token: false,
                    v1: false,
                    rebalance_seen: None,
                }))
            }
            NoticeKind::Gcp => Source::Gcp(Gcp {
                url: endpoint(given, GCP_NOTICE_URL)?,
                checked: false,
                etag: None,
                wait_timeout_ms: cfg.gcp_wait_timeout_ms.max(1_000),
            }),
            NoticeKind::Azure => Source::Azure(Azure {
                url: endpoint(given, AZURE_NOTICE_URL)?,
                vm_name: cfg.azure_vm_name.clone().filter(|n| !n.is_empty()),
            }),
            NoticeKind::Generic => {
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

struct Aws {
    token_url: Url,
    action_url: Url,
    /// `None` under `--rebalance-action ignore`.
    rebalance_url: Option<Url>,
    rebalance_drains: bool,
    ttl_s: u64,
    /// The token and when to renew it.
    token: Option<(String, Instant)>,
    /// A token was issued once: the token endpoint exists, so no IMDSv1 from now on.
    had_token: bool,
    /// The token endpoint is absent (404/405 on the first PUT): tokenless GETs.
    v1: bool,
    /// The `noticeTime` of the rebalance recommendation already sent.
    rebalance_seen: Option<String>,
}

impl Aws {
    async fn round(&mut self, http: &Http) -> Result<Option<Notice>, NoticeError> {
        let url = self.action_url.clone();
        if let Some(why) = self.get(http, &url, aws_instance_action).await? {
            return Ok(Some(Notice::Preempt {
                why,
                approval: None,
            }));
        }
        let Some(url) = self.rebalance_url.clone() else {
            return Ok(None);
        };
        match self.get(http, &url, aws_rebalance).await? {
            Some(t) if self.rebalance_seen.as_ref() != Some(&t) => {
                let why = format!("AWS rebalance recommendation at {t}");
                self.rebalance_seen = Some(t);
                Ok(Some(if self.rebalance_drains {
                    Notice::Preempt {
                        why,
                        approval: None,
                    }
                } else {
                    Notice::Rebalance { why }
                }))
            }
            _ => Ok(None),
        }
    }

    /// A GET with the current token; a 401 to a token this side still thought valid (IMDS
    /// restarted, say) gets one retry with a new token.
    async fn get<T>(
        &mut self,
        http: &Http,
        url: &Url,
        decide: fn(u16, &str) -> Result<Option<T>, Bad>,
    ) -> Result<Option<T>, NoticeError> {
        let mut a = self.get_once(http, url).await?;
        if a.status == 401 && self.token.take().is_some() {
            a = self.get_once(http, url).await?;
        }
        decide(a.status, &a.body).map_err(|b| b.at(url, &a))
    }

    async fn get_once(&mut self, http: &Http, url: &Url) -> Result<Answer, NoticeError> {
        let token = self.token(http).await?;
        let mut req = http.client.get(url.clone());
        if let Some(t) = token {
            req = req.header(AWS_TOKEN_HEADER, t);
        }
        http.send(req, url, request_timeout()).await
    }

    /// The token to send, `None` in IMDSv1 mode.
    async fn token(&mut self, http: &Http) -> Result<Option<String>, NoticeError> {
        if self.v1 {
            return Ok(None);
        }
        if let Some((t, renew_at)) = &self.token
            && Instant::now() < *renew_at
        {
            return Ok(Some(t.clone()));
        }
        self.token = None;
        // Counted from before the request: the token expires `ttl_s` after IMDS issued it.
        let asked = Instant::now();
        let req = http
            .client
            .put(self.token_url.clone())
            .header(AWS_TOKEN_TTL_HEADER, self.ttl_s.to_string());
        let a = http.send(req, &self.token_url, request_timeout()).await?;
        match aws_token(a.status, &a.body).map_err(|b| b.at(&self.token_url, &a))? {
            Some(t) => {
                self.had_token = true;
                let renew_at = asked + Duration::from_millis(self.ttl_s * 1_000 / 2);
                self.token = Some((t.clone(), renew_at));
                Ok(Some(t))
            }
            None if !self.had_token => {
                tracing::warn!(url = %self.token_url, status = a.status, "no IMDSv2 token endpoint; asking without tokens (IMDSv1)");
                self.v1 = true;
                Ok(None)
            }
            None => Err(NoticeError::Protocol {
                url: self.token_url.to_string(),
                what: format!(
                    "answered {} after issuing tokens; not falling back to IMDSv1",
                    a.status
                ),
            }),
        }
    }
}

struct Gcp {
    url: Url,
    /// The value was read once: from now on, wait for it to change.
    checked: bool,
    /// The `ETag` of the value read last.
    etag: Option<String>,
    wait_timeout_ms: u64,
}

impl Gcp {
    async fn round(&mut self, http: &Http) -> Result<Option<Notice>, NoticeError> {
        let mut url = self.url.clone();
        let timeout = if self.checked {
            let mut q = url.query_pairs_mut();
            q.append_pair("wait_for_change", "true");
            // With the last ETag, a change between two requests returns at once.
            if let Some(e) = &self.etag {
                q.append_pair("last_etag", e);
            }
            q.append_pair(
                "timeout_sec",
                &self.wait_timeout_ms.div_ceil(1_000).to_string(),
            );
            drop(q);
            Duration::from_millis(self.wait_timeout_ms + REQUEST_TIMEOUT_MS)
        } else {
            request_timeout()
        };
        let req = http
            .client
            .get(url.clone())
            .header("Metadata-Flavor", "Google");
        let a = http.send(req, &url, timeout).await?;
        let preempted = gcp_preempted(a.status, &a.body).map_err(|b| b.at(&url, &a))?;
        self.checked = true;
        if a.etag.is_some() {
            self.etag = a.etag;
        }
        Ok(preempted.then(|| Notice::Preempt {
            why: "GCP instance preempted".to_string(),
            approval: None,
        }))
    }
}

struct Azure {
    url: Url,
    vm_name: Option<String>,
}

impl Azure {
    async fn round(&mut self, http: &Http) -> Result<Option<Notice>, NoticeError> {
        let req = http.client.get(self.url.clone()).header("Metadata", "true");
        let a = http.send(req, &self.url, request_timeout()).await?;
        let event = azure_event(a.status, &a.body, self.vm_name.as_deref())
            .map_err(|b| b.at(&self.url, &a))?;
        Ok(event.map(|e| Notice::Preempt {
            why: format!(
                "Azure scheduled {} event {} (not before {})",
                e.event_type,
                e.id,
                quote(&e.not_before)
            ),
            approval: Some(Approval {
                url: self.url.clone(),
                event_id: e.id,
            }),
        }))
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
    use super::*;
    use services::metadata::{Azure as AzureServer, Gce, Imds};

    fn cfg(kind: NoticeKind, url: &str) -> Config {
        Config::new(
            PreemptionNotice {
                kind,
                url: url.to_string(),
            },
            Duration::from_millis(50),
        )
    }

    fn watch(c: &Config) -> Watch {
        Watch::new(c).unwrap()
    }

    fn is_preempt(n: &Option<Notice>) -> bool {
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

    #[test]
    fn azure_events_keep_preempt_and_terminate_for_this_vm() {
        let doc = |events: &str| format!(r#"{{"DocumentIncarnation": 2, "Events": [{events}]}}"#);
        let ev = |id: &str, ty: &str, vm: &str| {
            format!(
                r#"{{"EventId": "{id}", "EventType": "{ty}", "Resources": ["{vm}"], "NotBefore": "soon"}}"#
            )
        };
        assert_eq!(azure_event(200, &doc(""), None), Ok(None));
        let reboot = doc(&ev("r", "Reboot", "vm-a"));
        assert_eq!(azure_event(200, &reboot, None), Ok(None));
        let two = doc(&format!(
            "{},{}",
            ev("b", "Terminate", "vm-b"),
            ev("a", "Preempt", "VM-A")
        ));
        assert_eq!(azure_event(200, &two, None).unwrap().unwrap().id, "b");
        let mine = azure_event(200, &two, Some("vm-a")).unwrap().unwrap();
        assert_eq!(
            (mine.id.as_str(), mine.event_type.as_str()),
            ("a", "Preempt")
        );
        assert_eq!(azure_event(200, &two, Some("vm-c")), Ok(None));
        assert!(azure_event(200, "[]", None).is_err());
        assert!(azure_event(200, &doc(r#"{"EventType": "Preempt"}"#), None).is_err());
    }

    #[tokio::test]
    async fn aws_imdsv2_spot_interruption_is_seen() {
        let imds = Imds::start().unwrap();
        let mut w = watch(&cfg(NoticeKind::Aws, &imds.url()));
        assert_eq!(w.round().await.unwrap(), None);
        imds.set_instance_action("terminate");
        let n = w.round().await.unwrap();
        let Some(Notice::Preempt { why, approval }) = n else {
            panic!("{n:?}")
        };
        assert!(why.contains("terminate"), "{why}");
        assert_eq!(approval, None);
        assert_eq!(imds.token_puts(), 1, "one token serves both rounds");
        assert_eq!((imds.tokenless_gets(), imds.unauthorized()), (0, 0));
    }

    #[tokio::test]
    async fn aws_token_is_renewed_before_it_expires() {
        let imds = Imds::start().unwrap();
        let mut c = cfg(NoticeKind::Aws, &imds.url());
        c.aws_token_ttl_s = 2;
        let mut w = watch(&c);
        let t0 = std::time::Instant::now();
        while t0.elapsed() < Duration::from_millis(3_500) {
            // The server refuses expired tokens with 401: every round passing means renewal.
            assert_eq!(w.round().await.unwrap(), None);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(imds.token_puts() >= 3, "{} token PUTs", imds.token_puts());
        assert_eq!(imds.unauthorized(), 0);
    }

    #[tokio::test]
    async fn aws_falls_back_to_imdsv1_only_when_the_token_endpoint_is_absent() {
        for absent in [404, 405] {
            let imds = Imds::start_v1().unwrap();
            imds.set_token_answer(Some(absent));
            let mut w = watch(&cfg(NoticeKind::Aws, &imds.url()));
            assert_eq!(w.round().await.unwrap(), None);
            imds.set_instance_action("hibernate");
            assert!(is_preempt(&w.round().await.unwrap()));
            assert_eq!(imds.token_puts(), 1, "IMDSv1 is remembered");
            assert!(imds.tokenless_gets() >= 2);
        }
        // Refused, not absent: an auth error every round, and never a tokenless GET.
        for refused in [401, 403] {
            let imds = Imds::start().unwrap();
            imds.set_token_answer(Some(refused));
            let mut w = watch(&cfg(NoticeKind::Aws, &imds.url()));
            imds.set_instance_action("terminate");
            for _ in 0..2 {
                let e = w.round().await.unwrap_err();
                assert_eq!(e.kind(), ErrorKind::Auth, "{e}");
            }
            assert_eq!(imds.tokenless_gets(), 0);
        }
    }

    #[tokio::test]
    async fn aws_tokens_lost_after_issue_never_downgrade_to_imdsv1() {
        let imds = Imds::start().unwrap();
        let mut c = cfg(NoticeKind::Aws, &imds.url());
        c.aws_token_ttl_s = 2;
        let mut w = watch(&c);
        assert_eq!(w.round().await.unwrap(), None);
        imds.set_token_answer(Some(404));
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        let e = w.round().await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
        assert_eq!(imds.tokenless_gets(), 0);
    }

    #[tokio::test]
    async fn aws_rebalance_recommendation_follows_the_rebalance_action() {
        for (action, want) in [
            (RebalanceAction::Save, "rebalance"),
            (RebalanceAction::Drain, "preempt"),
            (RebalanceAction::Ignore, "none"),
        ] {
            let imds = Imds::start().unwrap();
            let mut c = cfg(NoticeKind::Aws, &format!("{}/", imds.url()));
            c.rebalance = action;
            let mut w = watch(&c);
            assert_eq!(w.round().await.unwrap(), None);
            imds.set_rebalance();
            let got = match w.round().await.unwrap() {
                Some(Notice::Rebalance { why }) => {
                    assert!(why.contains("rebalance"), "{why}");
                    "rebalance"
                }
                Some(Notice::Preempt { .. }) => "preempt",
                None => "none",
            };
            assert_eq!(got, want, "{action:?}");
            assert_eq!(w.round().await.unwrap(), None, "sent once per noticeTime");
        }
    }

    #[tokio::test]
    async fn gcp_wait_for_change_returns_as_soon_as_the_value_flips() {
        let gce = Arc::new(Gce::start().unwrap());
        let mut c = cfg(NoticeKind::Gcp, &gce.url());
        c.gcp_wait_timeout_ms = 20_000;
        let mut w = watch(&c);
        assert_eq!(
            w.round().await.unwrap(),
            None,
            "the first read does not wait"
        );
        let g = gce.clone();
        let flip = tokio::task::spawn_blocking(move || {
            std::thread::sleep(Duration::from_millis(400));
            g.set_preempted(true)
        });
        let t0 = std::time::Instant::now();
        let n = w.round().await.unwrap();
        let flipped = flip.await.unwrap();
        assert!(is_preempt(&n), "{n:?}");
        assert!(t0.elapsed() >= Duration::from_millis(350), "it waited");
        let lag = flipped.elapsed();
        assert!(lag < Duration::from_secs(1), "seen {lag:?} after the flip");
        assert_eq!((gce.waits(), gce.refused()), (1, 0));
    }

    #[tokio::test]
    async fn gcp_wait_is_bounded_by_its_timeout() {
        let gce = Gce::start().unwrap();
        let mut c = cfg(NoticeKind::Gcp, &gce.url());
        c.gcp_wait_timeout_ms = 1_000;
        let mut w = watch(&c);
        assert_eq!(w.round().await.unwrap(), None);
        let t0 = std::time::Instant::now();
        assert_eq!(w.round().await.unwrap(), None);
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_millis(900) && took < Duration::from_millis(2_500),
            "{took:?}"
        );
        // A flip between two waits is not lost: the next wait carries the last ETag.
        gce.set_preempted(true);
        let t0 = std::time::Instant::now();
        assert!(is_preempt(&w.round().await.unwrap()));
        assert!(t0.elapsed() < Duration::from_millis(500));
    }

    #[tokio::test]
    async fn azure_preempt_is_seen_and_approve_sends_its_event_id() {
        let az = AzureServer::start().unwrap();
        let mut c = cfg(NoticeKind::Azure, &az.url());
        c.azure_vm_name = Some("vm-a".into());
        let mut w = watch(&c);
        assert_eq!(w.round().await.unwrap(), None);
        az.add_event("Reboot", &["vm-a"]);
        az.add_event("Preempt", &["vm-b"]);
        assert_eq!(w.round().await.unwrap(), None, "not ours");
        let (id, _) = az.add_event("Preempt", &["vm-a"]);
        let n = w.round().await.unwrap();
        let Some(Notice::Preempt {
            why,
            approval: Some(approval),
        }) = n
        else {
            panic!("{n:?}")
        };
        assert!(why.contains(&id), "{why}");
        assert_eq!(approval.event_id, id);
        let state = AgentState::new("/tmp".into());
        approve(&approval, &state.metrics).await;
        let approvals = az.approvals();
        assert_eq!(approvals.len(), 1);
        assert_eq!(approvals[0].event_ids, vec![id]);
        assert_eq!(az.refused(), 0);
        assert!(
            ErrorKind::ALL
                .iter()
                .all(|k| state.metrics.notice_errors(*k) == 0)
        );
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
        poll(cfg(NoticeKind::Gcp, &gce.url()), state.clone(), tx).await;
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

    #[test]
    fn a_bare_host_gets_the_kinds_own_path() {
        let u = endpoint("http://127.0.0.1:9", AZURE_NOTICE_URL).unwrap();
        assert_eq!(
            u.as_str(),
            "http://127.0.0.1:9/metadata/scheduledevents?api-version=2020-07-01"
        );
        let u = endpoint("http://127.0.0.1:9/latest", AWS_NOTICE_URL).unwrap();
        assert_eq!(u.as_str(), "http://127.0.0.1:9/latest");
        assert!(endpoint("http://[bad", GCP_NOTICE_URL).is_err());
    }
}
