//! Local cloud instance metadata services on loopback, for the preemption-notice tests. Each one
//! enforces what the real service enforces, so a client that works against it speaks the real
//! protocol:
//!
//! - [`Imds`] (AWS IMDS): a GET without a valid, unexpired IMDSv2 token answers 401 (as on
//!   instances that require IMDSv2, the default for new ones); `PUT /latest/api/token` needs the
//!   `X-aws-ec2-metadata-token-ttl-seconds` header (400 otherwise). [`Imds::start_v1`] serves an
//!   IMDS without the token endpoint (404 on the PUT), which answers tokenless GETs.
//! - [`Gce`] (GCP metadata server): a request without `Metadata-Flavor: Google` answers 403;
//!   `wait_for_change=true` hangs until the value changes (or `timeout_sec`), and `last_etag`
//!   returns at once when the value changed since that ETag.
//! - [`Azure`] (Azure IMDS scheduled events): a request without `Metadata: true` answers 400;
//!   the approval POST (`StartRequests`) is recorded with its EventIds and arrival time.
//!
//! Every server is a thread per connection behind one accept thread, bounded in connections,
//! request size and wait time; one request per connection (`Connection: close`). Dropping the
//! handle stops it and wakes any hanging request.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use serde_json::{Value, json};

/// Connections served at once; more get 503.
const CONNECTIONS_MAX: usize = 64;
/// Longest request head read.
const HEAD_BYTES_MAX: usize = 16 * 1024;
/// Longest request body read.
const BODY_BYTES_MAX: usize = 64 * 1024;
/// Socket read and write timeout per connection.
const IO_TIMEOUT_MS: u64 = 5_000;
/// Longest `wait_for_change` the GCP server holds a request, whatever `timeout_sec` says.
pub const GCE_WAIT_S_MAX: u64 = 300;
/// How long the GCP server holds a `wait_for_change` request without `timeout_sec`.
const GCE_WAIT_S_DEFAULT: u64 = 60;
/// IMDS's largest token TTL, in seconds.
pub const IMDS_TOKEN_TTL_S_MAX: u64 = 21_600;
/// Tokens the IMDS server remembers; older ones stop being valid.
const IMDS_TOKENS_MAX: usize = 64;
/// Approvals the Azure server records.
const AZURE_APPROVALS_MAX: usize = 1_024;
/// Events the Azure server holds.
const AZURE_EVENTS_MAX: usize = 64;

/// The AWS instance-action path.
pub const IMDS_INSTANCE_ACTION_PATH: &str = "/latest/meta-data/spot/instance-action";
/// The AWS rebalance-recommendation path.
pub const IMDS_REBALANCE_PATH: &str = "/latest/meta-data/events/recommendations/rebalance";
/// The IMDSv2 token path.
pub const IMDS_TOKEN_PATH: &str = "/latest/api/token";
/// The GCP preemption path.
pub const GCE_PREEMPTED_PATH: &str = "/computeMetadata/v1/instance/preempted";
/// The Azure scheduled-events path.
pub const AZURE_EVENTS_PATH: &str = "/metadata/scheduledevents";

// ---- a tiny HTTP/1.1 server ---------------------------------------------------------------------

/// One parsed request.
#[derive(Debug)]
struct Request {
    method: String,
    path: String,
    query: Vec<(String, String)>,
    /// Names lowercased.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Request {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn query(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One answer.
struct Reply {
    status: u16,
    headers: Vec<(&'static str, String)>,
    body: String,
}

impl Reply {
    fn new(status: u16, body: impl Into<String>) -> Self {
        Reply {
            status,
            headers: vec![],
            body: body.into(),
        }
    }

    fn header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        503 => "Service Unavailable",
        _ => "Other",
    }
}

type Handler = dyn Fn(&Request) -> Reply + Send + Sync;

/// The accept thread and its stop switch.
struct Server {
    port: u16,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl Server {
    fn start(handler: Arc<Handler>) -> Result<Server> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .context("binding a loopback port for a metadata server")?;
        let port = listener.local_addr()?.port();
        let stop = Arc::new(AtomicBool::new(false));
        let live = Arc::new(AtomicUsize::new(0));
        let stop2 = stop.clone();
        let accept = std::thread::Builder::new()
            .name(format!("metadata-{port}"))
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop2.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(stream) = conn else {
                        // Out of descriptors, say: do not spin.
                        std::thread::sleep(Duration::from_millis(10));
                        continue;
                    };
                    let handler = handler.clone();
                    let live = live.clone();
                    if live.fetch_add(1, Ordering::SeqCst) >= CONNECTIONS_MAX {
                        live.fetch_sub(1, Ordering::SeqCst);
                        let _ = write_reply(stream, Reply::new(503, "too many connections"));
                        continue;
                    }
                    std::thread::spawn(move || {
                        serve_one(stream, &*handler);
                        live.fetch_sub(1, Ordering::SeqCst);
                    });
                }
            })
            .context("spawning a metadata server thread")?;
        Ok(Server {
            port,
            stop,
            accept: Some(accept),
        })
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so that it sees the flag.
        let _ = TcpStream::connect_timeout(
            &SocketAddr::from((Ipv4Addr::LOCALHOST, self.port)),
            Duration::from_millis(IO_TIMEOUT_MS),
        );
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn serve_one(mut stream: TcpStream, handler: &Handler) {
    let timeout = Some(Duration::from_millis(IO_TIMEOUT_MS));
    if stream.set_read_timeout(timeout).is_err() || stream.set_write_timeout(timeout).is_err() {
        return;
    }
    let reply = match read_request(&mut stream) {
        Some(req) => handler(&req),
        None => Reply::new(400, "malformed request"),
    };
    let _ = write_reply(stream, reply);
}

fn read_request(stream: &mut TcpStream) -> Option<Request> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        if buf.len() > HEAD_BYTES_MAX {
            return None;
        }
        let n = stream.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = std::str::from_utf8(&buf[..head_end]).ok()?;
    let mut lines = head.split("\r\n");
    let mut first = lines.next()?.split(' ');
    let method = first.next()?.to_string();
    let target = first.next()?;
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p, q),
        None => (target, ""),
    };
    let query = query
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| match kv.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => (kv.to_string(), String::new()),
        })
        .collect();
    let mut headers = Vec::new();
    for line in lines {
        let (k, v) = line.split_once(':')?;
        headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
    }
    let len: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .map(|(_, v)| v.parse().ok())
        .unwrap_or(Some(0))?;
    if len > BODY_BYTES_MAX {
        return None;
    }
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < len {
        let n = stream.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(len);
    Some(Request {
        method,
        path: path.to_string(),
        query,
        headers,
        body,
    })
}

fn write_reply(mut stream: TcpStream, reply: Reply) -> std::io::Result<()> {
    let mut out = format!(
        "HTTP/1.1 {} {}\r\nContent-Length: {}\r\nConnection: close\r\n",
        reply.status,
        reason(reply.status),
        reply.body.len()
    );
    for (k, v) in &reply.headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("\r\n");
    out.push_str(&reply.body);
    stream.write_all(out.as_bytes())?;
    stream.flush()
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// RFC 3339 (UTC, seconds) for a unix time, as IMDS writes `time` and `noticeTime`.
fn rfc3339(t: SystemTime) -> String {
    let secs = t
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3_600,
        rem % 3_600 / 60,
        rem % 60
    )
}

// ---- AWS IMDS -----------------------------------------------------------------------------------

#[derive(Debug, Default)]
struct ImdsState {
    /// Tokenless GETs are refused (IMDSv2 required).
    tokens_required: bool,
    /// Forced status of the token PUT (404/405: no token endpoint; 403: refused).
    token_answer: Option<u16>,
    /// Issued tokens and when they expire.
    tokens: Vec<(String, Instant)>,
    tokens_issued: u64,
    instance_action: Option<String>,
    rebalance: Option<String>,
    token_puts: u32,
    tokenless_gets: u32,
    unauthorized: u32,
}

/// A local AWS instance metadata service (IMDS) serving spot `instance-action` and the
/// rebalance recommendation.
pub struct Imds {
    server: Server,
    state: Arc<Mutex<ImdsState>>,
}

impl Imds {
    /// IMDS that requires IMDSv2 tokens (the default for new instances).
    pub fn start() -> Result<Imds> {
        Self::start_with(ImdsState {
            tokens_required: true,
            ..ImdsState::default()
        })
    }

    /// IMDS without the token endpoint (404 on the PUT), answering tokenless GETs.
    pub fn start_v1() -> Result<Imds> {
        Self::start_with(ImdsState {
            tokens_required: false,
            token_answer: Some(404),
            ..ImdsState::default()
        })
    }

    fn start_with(state: ImdsState) -> Result<Imds> {
        let state = Arc::new(Mutex::new(state));
        let s = state.clone();
        let server = Server::start(Arc::new(move |req: &Request| imds_handle(&s, req)))?;
        Ok(Imds { server, state })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        self.server.url()
    }

    /// Schedules a spot interruption (`terminate`, `stop` or `hibernate`) two minutes from now;
    /// returns when it became visible.
    pub fn set_instance_action(&self, action: &str) -> Instant {
        let time = rfc3339(SystemTime::now() + Duration::from_secs(120));
        let body = json!({"action": action, "time": time}).to_string();
        let mut s = lock(&self.state);
        s.instance_action = Some(body);
        Instant::now()
    }

    /// Posts a rebalance recommendation; returns when it became visible.
    pub fn set_rebalance(&self) -> Instant {
        let body = json!({"noticeTime": rfc3339(SystemTime::now())}).to_string();
        let mut s = lock(&self.state);
        s.rebalance = Some(body);
        Instant::now()
    }

    /// Forces the token PUT's answer (`Some(403)`, `Some(405)`), or restores it (`None`).
    pub fn set_token_answer(&self, status: Option<u16>) {
        lock(&self.state).token_answer = status;
    }

    /// Token PUTs received (answered or not).
    pub fn token_puts(&self) -> u32 {
        lock(&self.state).token_puts
    }

    /// GETs that carried no token.
    pub fn tokenless_gets(&self) -> u32 {
        lock(&self.state).tokenless_gets
    }

    /// 401 answers given.
    pub fn unauthorized(&self) -> u32 {
        lock(&self.state).unauthorized
    }
}

fn imds_handle(state: &Mutex<ImdsState>, req: &Request) -> Reply {
    let mut s = lock(state);
    // IMDS refuses anything forwarded by a proxy.
    if req.header("x-forwarded-for").is_some() {
        return Reply::new(403, "Forbidden");
    }
    if req.path == IMDS_TOKEN_PATH {
        s.token_puts += 1;
        if let Some(status) = s.token_answer {
            return Reply::new(status, reason(status));
        }
        if req.method != "PUT" {
            return Reply::new(405, "Method Not Allowed");
        }
        let ttl_s = req
            .header("x-aws-ec2-metadata-token-ttl-seconds")
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|t| (1..=IMDS_TOKEN_TTL_S_MAX).contains(t));
        let Some(ttl_s) = ttl_s else {
            return Reply::new(400, "Bad Request");
        };
        s.tokens_issued += 1;
        let token = format!("AQAEAtest-token-{:06}", s.tokens_issued);
        s.tokens
            .push((token.clone(), Instant::now() + Duration::from_secs(ttl_s)));
        if s.tokens.len() > IMDS_TOKENS_MAX {
            s.tokens.remove(0);
        }
        return Reply::new(200, token)
            .header("X-aws-ec2-metadata-token-ttl-seconds", ttl_s.to_string());
    }
    if req.method != "GET" {
        return Reply::new(405, "Method Not Allowed");
    }
    match req.header("x-aws-ec2-metadata-token") {
        Some(t) => {
            let now = Instant::now();
            if !s.tokens.iter().any(|(v, exp)| v == t && *exp > now) {
                s.unauthorized += 1;
                return Reply::new(401, "Unauthorized");
            }
        }
        None => {
            s.tokenless_gets += 1;
            if s.tokens_required {
                s.unauthorized += 1;
                return Reply::new(401, "Unauthorized");
            }
        }
    }
    let doc = match req.path.as_str() {
        IMDS_INSTANCE_ACTION_PATH => s.instance_action.clone(),
        IMDS_REBALANCE_PATH => s.rebalance.clone(),
        _ => None,
    };
    match doc {
        Some(body) => Reply::new(200, body).header("Content-Type", "text/plain"),
        None => Reply::new(404, "Not Found"),
    }
}

// ---- GCP metadata server ------------------------------------------------------------------------

#[derive(Debug, Default)]
struct GceState {
    preempted: bool,
    stopped: bool,
    requests: u32,
    waits: u32,
    refused: u32,
}

/// A local GCP metadata server serving `instance/preempted`.
pub struct Gce {
    server: Server,
    state: Arc<(Mutex<GceState>, Condvar)>,
}

impl Gce {
    pub fn start() -> Result<Gce> {
        let state = Arc::new((Mutex::new(GceState::default()), Condvar::new()));
        let s = state.clone();
        let server = Server::start(Arc::new(move |req: &Request| gce_handle(&s, req)))?;
        Ok(Gce { server, state })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        self.server.url()
    }

    /// Sets `preempted` and wakes the requests waiting for a change; returns when it changed.
    pub fn set_preempted(&self, preempted: bool) -> Instant {
        let (m, cv) = &*self.state;
        let mut s = lock(m);
        s.preempted = preempted;
        cv.notify_all();
        Instant::now()
    }

    /// Requests for `preempted` answered (any answer).
    pub fn requests(&self) -> u32 {
        lock(&self.state.0).requests
    }

    /// Of those, `wait_for_change=true` requests.
    pub fn waits(&self) -> u32 {
        lock(&self.state.0).waits
    }

    /// Requests refused with 403 (no `Metadata-Flavor: Google`).
    pub fn refused(&self) -> u32 {
        lock(&self.state.0).refused
    }
}

impl Drop for Gce {
    fn drop(&mut self) {
        let (m, cv) = &*self.state;
        lock(m).stopped = true;
        cv.notify_all();
    }
}

/// The server's ETag of a value: a hash of the content, as GCE's is.
fn gce_etag(preempted: bool) -> String {
    let text = if preempted { "TRUE" } else { "FALSE" };
    // FNV-1a: stable across runs, which a content ETag must be.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn gce_handle(state: &(Mutex<GceState>, Condvar), req: &Request) -> Reply {
    let (m, cv) = state;
    let mut s = lock(m);
    if req.header("metadata-flavor") != Some("Google") || req.header("x-forwarded-for").is_some() {
        s.refused += 1;
        return Reply::new(403, "Forbidden: missing Metadata-Flavor: Google header");
    }
    if req.path != GCE_PREEMPTED_PATH {
        return Reply::new(404, "Not Found");
    }
    if req.method != "GET" {
        return Reply::new(405, "Method Not Allowed");
    }
    s.requests += 1;
    if req.query("wait_for_change") == Some("true") {
        s.waits += 1;
        let timeout_s = match req.query("timeout_sec") {
            Some(t) => match t.parse::<u64>() {
                Ok(t) if t > 0 => t.min(GCE_WAIT_S_MAX),
                _ => return Reply::new(400, "bad timeout_sec"),
            },
            None => GCE_WAIT_S_DEFAULT,
        };
        let start = gce_etag(s.preempted);
        // With `last_etag`, a value that already changed since that ETag returns at once.
        let changed_already = req.query("last_etag").is_some_and(|e| e != start);
        if !changed_already {
            let deadline = Instant::now() + Duration::from_secs(timeout_s);
            while !s.stopped && gce_etag(s.preempted) == start {
                let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                    break;
                };
                s = cv
                    .wait_timeout(s, left)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
    }
    let body = if s.preempted { "TRUE" } else { "FALSE" };
    Reply::new(200, body)
        .header("Metadata-Flavor", "Google")
        .header("Content-Type", "application/text")
        .header("ETag", gce_etag(s.preempted))
}

// ---- Azure scheduled events ---------------------------------------------------------------------

#[derive(Debug, Clone)]
struct AzureEvent {
    id: String,
    event_type: String,
    resources: Vec<String>,
    started: bool,
}

/// One approval POST the Azure server accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AzureApproval {
    /// The EventIds in `StartRequests`, in order.
    pub event_ids: Vec<String>,
    /// When it arrived.
    pub at: Instant,
    /// When it arrived, in unix milliseconds (to compare with `--events-file` `ts_ms`).
    pub unix_ms: u64,
}

#[derive(Debug, Default)]
struct AzureState {
    incarnation: u64,
    events: Vec<AzureEvent>,
    approvals: Vec<AzureApproval>,
    refused: u32,
}

/// A local Azure IMDS serving scheduled events.
pub struct Azure {
    server: Server,
    state: Arc<Mutex<AzureState>>,
}

impl Azure {
    pub fn start() -> Result<Azure> {
        let state = Arc::new(Mutex::new(AzureState {
            incarnation: 1,
            ..AzureState::default()
        }));
        let s = state.clone();
        let server = Server::start(Arc::new(move |req: &Request| azure_handle(&s, req)))?;
        Ok(Azure { server, state })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        self.server.url()
    }

    /// Schedules an event (`Preempt`, `Terminate`, `Reboot`, `Redeploy`, `Freeze`) for these VM
    /// names; returns its EventId and when it became visible.
    pub fn add_event(&self, event_type: &str, resources: &[&str]) -> (String, Instant) {
        let mut s = lock(&self.state);
        s.incarnation += 1;
        let id = format!(
            "{:08X}-0000-4000-8000-{:012X}",
            s.incarnation,
            unix_ms(SystemTime::now())
        );
        s.events.push(AzureEvent {
            id: id.clone(),
            event_type: event_type.to_string(),
            resources: resources.iter().map(|r| r.to_string()).collect(),
            started: false,
        });
        if s.events.len() > AZURE_EVENTS_MAX {
            s.events.remove(0);
        }
        (id, Instant::now())
    }

    /// The approval POSTs accepted so far.
    pub fn approvals(&self) -> Vec<AzureApproval> {
        lock(&self.state).approvals.clone()
    }

    /// Requests refused with 400 (no `Metadata: true`, or no `api-version`).
    pub fn refused(&self) -> u32 {
        lock(&self.state).refused
    }
}

fn azure_handle(state: &Mutex<AzureState>, req: &Request) -> Reply {
    let mut s = lock(state);
    let bad = |s: &mut AzureState, why: &str| {
        s.refused += 1;
        Reply::new(400, json!({"error": why}).to_string())
    };
    if req.header("metadata") != Some("true") || req.header("x-forwarded-for").is_some() {
        return bad(
            &mut s,
            "Bad request. Required metadata header not specified",
        );
    }
    if req.path != AZURE_EVENTS_PATH {
        return Reply::new(404, "Not Found");
    }
    if req.query("api-version").is_none_or(str::is_empty) {
        return bad(&mut s, "Bad request. api-version was not specified");
    }
    match req.method.as_str() {
        "GET" => {
            let not_before = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(30));
            let events: Vec<Value> = s
                .events
                .iter()
                .map(|e| {
                    json!({
                        "EventId": e.id,
                        "EventStatus": if e.started { "Started" } else { "Scheduled" },
                        "EventType": e.event_type,
                        "ResourceType": "VirtualMachine",
                        "Resources": e.resources,
                        "NotBefore": if e.started { String::new() } else { not_before.clone() },
                        "Description": "",
                        "EventSource": "Platform",
                        "DurationInSeconds": -1,
                    })
                })
                .collect();
            let doc = json!({"DocumentIncarnation": s.incarnation, "Events": events});
            Reply::new(200, doc.to_string()).header("Content-Type", "application/json")
        }
        "POST" => {
            let ids: Option<Vec<String>> = serde_json::from_slice::<Value>(&req.body)
                .ok()
                .and_then(|v| {
                    v.get("StartRequests")?
                        .as_array()?
                        .iter()
                        .map(|r| Some(r.get("EventId")?.as_str()?.to_string()))
                        .collect()
                });
            let Some(ids) = ids.filter(|ids| !ids.is_empty()) else {
                return bad(&mut s, "Bad request. StartRequests expected");
            };
            if !ids.iter().all(|id| s.events.iter().any(|e| e.id == *id)) {
                return bad(&mut s, "Bad request. Unknown EventId");
            }
            for e in s.events.iter_mut().filter(|e| ids.contains(&e.id)) {
                e.started = true;
            }
            s.incarnation += 1;
            if s.approvals.len() < AZURE_APPROVALS_MAX {
                s.approvals.push(AzureApproval {
                    event_ids: ids,
                    at: Instant::now(),
                    unix_ms: unix_ms(SystemTime::now()),
                });
            }
            Reply::new(200, "")
        }
        _ => Reply::new(405, "Method Not Allowed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http;

    fn port(url: &str) -> u16 {
        url.rsplit(':').next().unwrap().parse().unwrap()
    }

    fn h(k: &str, v: &str) -> (String, String) {
        (k.to_string(), v.to_string())
    }

    #[test]
    fn rfc3339_formats_known_instants() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(1_767_225_600 + 3_661)),
            "2026-01-01T01:01:01Z"
        );
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(951_782_400)),
            "2000-02-29T00:00:00Z"
        );
    }

    #[test]
    fn imds_requires_a_token_and_the_ttl_header() {
        let imds = Imds::start().unwrap();
        let p = port(&imds.url());
        assert_eq!(http::get(p, IMDS_INSTANCE_ACTION_PATH).unwrap().0, 401);
        assert_eq!(
            http::request(p, "PUT", IMDS_TOKEN_PATH, &[], b"")
                .unwrap()
                .0,
            400
        );
        let (status, token) = http::request(
            p,
            "PUT",
            IMDS_TOKEN_PATH,
            &[h("X-aws-ec2-metadata-token-ttl-seconds", "60")],
            b"",
        )
        .unwrap();
        assert_eq!(status, 200);
        let auth = [h("X-aws-ec2-metadata-token", &token)];
        let get = |path| http::request(p, "GET", path, &auth, b"").unwrap();
        assert_eq!(get(IMDS_INSTANCE_ACTION_PATH).0, 404);
        imds.set_instance_action("terminate");
        let (status, body) = get(IMDS_INSTANCE_ACTION_PATH);
        assert_eq!(status, 200);
        assert!(body.contains("\"terminate\""), "{body}");
        assert_eq!(get(IMDS_REBALANCE_PATH).0, 404);
        imds.set_rebalance();
        assert!(get(IMDS_REBALANCE_PATH).1.contains("noticeTime"));
        let wrong = [h("X-aws-ec2-metadata-token", "forged")];
        assert_eq!(
            http::request(p, "GET", IMDS_INSTANCE_ACTION_PATH, &wrong, b"")
                .unwrap()
                .0,
            401
        );
        assert_eq!(imds.unauthorized(), 2);
        assert_eq!(imds.token_puts(), 2);
    }

    #[test]
    fn gce_refuses_without_the_flavor_header_and_waits_for_a_change() {
        let gce = Arc::new(Gce::start().unwrap());
        let p = port(&gce.url());
        assert_eq!(http::get(p, GCE_PREEMPTED_PATH).unwrap().0, 403);
        let flavor = [h("Metadata-Flavor", "Google")];
        let (status, body) = http::request(p, "GET", GCE_PREEMPTED_PATH, &flavor, b"").unwrap();
        assert_eq!((status, body.as_str()), (200, "FALSE"));
        let g = gce.clone();
        let flipper = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            g.set_preempted(true)
        });
        let t0 = Instant::now();
        let path = format!("{GCE_PREEMPTED_PATH}?wait_for_change=true&timeout_sec=20");
        let (_, body) = http::request(p, "GET", &path, &flavor, b"").unwrap();
        let flipped = flipper.join().unwrap();
        assert_eq!(body, "TRUE");
        assert!(t0.elapsed() >= Duration::from_millis(250));
        assert!(flipped.elapsed() < Duration::from_secs(2));
        // A stale ETag returns at once.
        let stale = format!(
            "{GCE_PREEMPTED_PATH}?wait_for_change=true&timeout_sec=20&last_etag={}",
            gce_etag(false)
        );
        let t0 = Instant::now();
        assert_eq!(
            http::request(p, "GET", &stale, &flavor, b"").unwrap().1,
            "TRUE"
        );
        assert!(t0.elapsed() < Duration::from_secs(2));
        assert_eq!((gce.refused(), gce.waits()), (1, 2));
    }

    #[test]
    fn azure_refuses_without_the_metadata_header_and_records_approvals() {
        let az = Azure::start().unwrap();
        let p = port(&az.url());
        let path = format!("{AZURE_EVENTS_PATH}?api-version=2020-07-01");
        assert_eq!(http::get(p, &path).unwrap().0, 400);
        let md = [h("Metadata", "true")];
        let (id, _) = az.add_event("Preempt", &["vm-1"]);
        let (status, body) = http::request(p, "GET", &path, &md, b"").unwrap();
        assert_eq!(status, 200);
        let doc: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(doc["Events"][0]["EventId"], id.as_str());
        assert_eq!(doc["Events"][0]["Resources"][0], "vm-1");
        let bad = br#"{"StartRequests":[{"EventId":"nope"}]}"#;
        assert_eq!(http::request(p, "POST", &path, &md, bad).unwrap().0, 400);
        let good = json!({"StartRequests": [{"EventId": id}]}).to_string();
        assert_eq!(
            http::request(p, "POST", &path, &md, good.as_bytes())
                .unwrap()
                .0,
            200
        );
        let approvals = az.approvals();
        assert_eq!(approvals.len(), 1);
        assert_eq!(approvals[0].event_ids, vec![id]);
        assert_eq!(az.refused(), 2);
    }
}
