//! A local AWS instance metadata service (IMDS) that enforces IMDSv2 tokens.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Result;
use serde_json::json;

use super::server::{Reply, Request, Server, lock, reason};

/// IMDS's largest token TTL, in seconds.
pub const IMDS_TOKEN_TTL_S_MAX: u64 = 21_600;
/// Tokens the IMDS server remembers; older ones stop being valid.
const IMDS_TOKENS_MAX: usize = 64;

/// The AWS instance-action path.
pub const IMDS_INSTANCE_ACTION_PATH: &str = "/latest/meta-data/spot/instance-action";
/// The AWS rebalance-recommendation path.
pub const IMDS_REBALANCE_PATH: &str = "/latest/meta-data/events/recommendations/rebalance";
/// The IMDSv2 token path.
pub const IMDS_TOKEN_PATH: &str = "/latest/api/token";

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

#[cfg(test)]
mod tests {
    use super::super::server::testing::{h, port};
    use super::*;
    use crate::http;

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
}
