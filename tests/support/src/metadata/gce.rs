//! A local GCP metadata server serving `instance/preempted`, with `wait_for_change`.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;

use super::server::{Reply, Request, Server, lock};

/// Longest `wait_for_change` the GCP server holds a request, whatever `timeout_sec` says.
pub const GCE_WAIT_S_MAX: u64 = 300;
/// How long the GCP server holds a `wait_for_change` request without `timeout_sec`.
const GCE_WAIT_S_DEFAULT: u64 = 60;
/// The GCP preemption path.
pub const GCE_PREEMPTED_PATH: &str = "/computeMetadata/v1/instance/preempted";

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

#[cfg(test)]
mod tests {
    use super::super::server::testing::{h, port};
    use super::*;
    use crate::http;

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
}
