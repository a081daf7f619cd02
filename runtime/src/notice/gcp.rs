//! GCP: `instance/preempted`, read once and then waited on (`wait_for_change`), so a
//! preemption arrives as it happens.

use std::time::Duration;

use reqwest::Url;

use super::http::{Bad, Http, endpoint, quote, request_timeout, status_bad};
use super::{Config, Notice, NoticeError, REQUEST_TIMEOUT_MS};
use crate::cli::GCP_NOTICE_URL;

/// GCP `preempted`: `TRUE` or `FALSE`.
pub(super) fn gcp_preempted(status: u16, body: &str) -> Result<bool, Bad> {
    match (status, body.trim()) {
        (200, b) if b.eq_ignore_ascii_case("true") => Ok(true),
        (200, b) if b.eq_ignore_ascii_case("false") => Ok(false),
        (200, b) => Err(Bad::Unexpected(format!("preempted is {:?}", quote(b)))),
        (s, _) => Err(status_bad(s)),
    }
}

pub(super) struct Gcp {
    pub(super) url: Url,
    /// The value was read once: from now on, wait for it to change.
    checked: bool,
    /// The `ETag` of the value read last.
    etag: Option<String>,
    wait_timeout_ms: u64,
}

impl Gcp {
    pub(super) fn new(cfg: &Config) -> Result<Gcp, NoticeError> {
        Ok(Gcp {
            url: endpoint(cfg.notice.url.as_str(), GCP_NOTICE_URL)?,
            checked: false,
            etag: None,
            wait_timeout_ms: cfg.gcp_wait_timeout_ms.max(1_000),
        })
    }

    pub(super) async fn round(&mut self, http: &Http) -> Result<Option<Notice>, NoticeError> {
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::tests::{cfg, is_preempt, watch};
    use super::*;
    use crate::cli::NoticeKind;
    use services::metadata::Gce;

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
}
