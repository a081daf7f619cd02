//! A local Azure IMDS serving scheduled events and recording their approvals.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Result;
use serde_json::{Value, json};

use super::server::{Reply, Request, Server, lock};

/// Approvals the Azure server records.
const AZURE_APPROVALS_MAX: usize = 1_024;
/// Events the Azure server holds.
const AZURE_EVENTS_MAX: usize = 64;
/// The Azure scheduled-events path.
pub const AZURE_EVENTS_PATH: &str = "/metadata/scheduledevents";

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

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
    use super::super::server::testing::{h, port};
    use super::*;
    use crate::http;

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
