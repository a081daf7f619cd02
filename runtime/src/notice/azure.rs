//! Azure: scheduled events (`Preempt`, `Terminate`) for this VM, and their approval once the
//! drain is done.

use reqwest::Url;
use reqwest::header::CONTENT_TYPE;
use serde_json::Value;

use super::http::{Bad, Http, endpoint, json, quote, request_timeout, status_bad};
use super::{Approval, Config, Notice, NoticeError};
use crate::cli::AZURE_NOTICE_URL;

pub(super) async fn approve_event(approval: &Approval) -> Result<(), NoticeError> {
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

/// An Azure event that takes this VM away.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct AzureEvent {
    pub(super) id: String,
    pub(super) event_type: String,
    not_before: String,
}

/// Azure scheduled events: the first `Preempt` or `Terminate` event for `vm` (any VM when
/// `None`).
pub(super) fn azure_event(
    status: u16,
    body: &str,
    vm: Option<&str>,
) -> Result<Option<AzureEvent>, Bad> {
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

pub(super) struct Azure {
    pub(super) url: Url,
    vm_name: Option<String>,
}

impl Azure {
    pub(super) fn new(cfg: &Config) -> Result<Azure, NoticeError> {
        Ok(Azure {
            url: endpoint(cfg.notice.url.as_str(), AZURE_NOTICE_URL)?,
            vm_name: cfg.azure_vm_name.clone().filter(|n| !n.is_empty()),
        })
    }

    pub(super) async fn round(&mut self, http: &Http) -> Result<Option<Notice>, NoticeError> {
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

#[cfg(test)]
mod tests {
    use super::super::tests::{cfg, watch};
    use super::*;
    use crate::cli::NoticeKind;
    use crate::notice::{ErrorKind, approve};
    use crate::state::AgentState;
    use services::metadata::Azure as AzureServer;

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
}
