//! Cloud preemption notices, polled over plain HTTP from the instance metadata service (or a
//! URL given on the command line, so tests and unusual clouds can serve one).
//!
//! - GCP: `GET /computeMetadata/v1/instance/preempted` with `Metadata-Flavor: Google`, body
//!   `TRUE` once preempted.
//! - AWS: `GET /latest/meta-data/spot/instance-action` (IMDSv2 token when available): 404 until
//!   an interruption is scheduled, then 200 with `{"action": ...}`.
//! - Azure: `GET /metadata/scheduledevents?api-version=2020-07-01` with `Metadata: true`: an
//!   event with `"EventType": "Preempt"`.
//! - Generic URL: any 2xx answer whose body is not empty, `false` or `FALSE`.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use crate::cli::{NoticeKind, PreemptionNotice};

/// Largest metadata answer read.
const RESPONSE_BYTES_MAX: usize = 64 * 1024;
/// Connect plus read, per request.
const REQUEST_TIMEOUT_MS: u64 = 2_000;

/// Polls `notice` every `every` until it reports a preemption, then sends why and returns.
pub async fn poll(notice: PreemptionNotice, every: Duration, out: mpsc::Sender<String>) {
    let mut warned = false;
    loop {
        match check(&notice).await {
            Ok(Some(why)) => {
                let _ = out.send(why).await;
                return;
            }
            Ok(None) => {}
            Err(e) if !warned => {
                warned = true;
                tracing::warn!(url = %notice.url, error = %e, "preemption notice poll failed (further failures at debug level)");
            }
            Err(e) => {
                tracing::debug!(url = %notice.url, error = %e, "preemption notice poll failed")
            }
        }
        tokio::time::sleep(every).await;
    }
}

/// One poll: `Some(reason)` when the machine is being preempted.
pub async fn check(notice: &PreemptionNotice) -> std::io::Result<Option<String>> {
    match notice.kind {
        NoticeKind::Gcp => {
            let (status, body) = get(&notice.url, &[("Metadata-Flavor", "Google")]).await?;
            Ok((status == 200 && body.trim().eq_ignore_ascii_case("true"))
                .then(|| "GCP instance preempted".to_string()))
        }
        NoticeKind::Aws => {
            let (status, body) = get(&notice.url, &[]).await?;
            Ok((status == 200 && body.contains("action"))
                .then(|| format!("AWS spot interruption: {}", body.trim())))
        }
        NoticeKind::Azure => {
            let (status, body) = get(&notice.url, &[("Metadata", "true")]).await?;
            if status != 200 {
                return Ok(None);
            }
            let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            let preempt = v
                .get("Events")
                .and_then(|e| e.as_array())
                .is_some_and(|events| {
                    events
                        .iter()
                        .any(|e| e.get("EventType").and_then(|t| t.as_str()) == Some("Preempt"))
                });
            Ok(preempt.then(|| "Azure scheduled Preempt event".to_string()))
        }
        NoticeKind::Generic => {
            let (status, body) = get(&notice.url, &[]).await?;
            let b = body.trim();
            Ok(
                ((200..300).contains(&status) && !b.is_empty() && !b.eq_ignore_ascii_case("false"))
                    .then(|| {
                        format!(
                            "preemption notice from {}: {}",
                            notice.url,
                            truncate(b, 200)
                        )
                    }),
            )
        }
    }
}

fn truncate(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// A minimal HTTP/1.1 GET (metadata services are plain HTTP on a link-local address).
async fn get(url: &str, headers: &[(&str, &str)]) -> std::io::Result<(u16, String)> {
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| bad("only http:// URLs"))?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let addr = if authority.contains(':') {
        authority.to_string()
    } else {
        format!("{authority}:80")
    };
    let io = async {
        let mut stream = TcpStream::connect(&addr).await?;
        let mut req = format!("GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n");
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        stream.write_all(req.as_bytes()).await?;
        let mut buf = Vec::new();
        (&mut stream)
            .take(RESPONSE_BYTES_MAX as u64)
            .read_to_end(&mut buf)
            .await?;
        Ok::<_, std::io::Error>(buf)
    };
    let buf = tokio::time::timeout(Duration::from_millis(REQUEST_TIMEOUT_MS), io)
        .await
        .map_err(|_| {
            std::io::Error::new(std::io::ErrorKind::TimedOut, "metadata request timed out")
        })??;
    parse_response(&buf).ok_or_else(|| bad("malformed HTTP response"))
}

fn parse_response(buf: &[u8]) -> Option<(u16, String)> {
    let split = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&buf[..split]).ok()?;
    let body = &buf[split + 4..];
    let status: u16 = head
        .lines()
        .next()?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_vec()
    };
    Some((status, String::from_utf8_lossy(&body).into_owned()))
}

fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n")?;
        let size_str = std::str::from_utf8(&b[..eol]).ok()?;
        let size = usize::from_str_radix(size_str.split(';').next()?.trim(), 16).ok()?;
        b = &b[eol + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(b.get(..size)?);
        b = b.get(size + 2..)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// Serves one canned response per connection, forever.
    async fn serve(response: &'static str) -> String {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let _ = s.write_all(response.as_bytes()).await;
            }
        });
        format!("http://{addr}/notice")
    }

    fn notice(kind: NoticeKind, url: String) -> PreemptionNotice {
        PreemptionNotice { kind, url }
    }

    #[tokio::test]
    async fn each_cloud_format_is_recognised() {
        let gcp_yes = serve("HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nTRUE").await;
        let gcp_no = serve("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nFALSE").await;
        let aws_no = serve("HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n").await;
        let aws_yes = serve("HTTP/1.1 200 OK\r\n\r\n{\"action\": \"terminate\", \"time\": \"2026-01-01T00:00:00Z\"}").await;
        let az_yes = serve("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1e\r\n{\"Events\":[{\"EventType\":\"Preem\r\n5\r\npt\"}]\r\n1\r\n}\r\n0\r\n\r\n").await;
        let az_no = serve("HTTP/1.1 200 OK\r\n\r\n{\"Events\":[{\"EventType\":\"Reboot\"}]}").await;
        assert!(
            check(&notice(NoticeKind::Gcp, gcp_yes))
                .await
                .unwrap()
                .is_some()
        );
        assert!(
            check(&notice(NoticeKind::Gcp, gcp_no.clone()))
                .await
                .unwrap()
                .is_none()
        );
        assert!(
            check(&notice(NoticeKind::Aws, aws_no.clone()))
                .await
                .unwrap()
                .is_none()
        );
        assert!(
            check(&notice(NoticeKind::Aws, aws_yes))
                .await
                .unwrap()
                .is_some()
        );
        assert!(
            check(&notice(NoticeKind::Azure, az_yes))
                .await
                .unwrap()
                .is_some()
        );
        assert!(
            check(&notice(NoticeKind::Azure, az_no))
                .await
                .unwrap()
                .is_none()
        );
        assert!(
            check(&notice(NoticeKind::Generic, gcp_no))
                .await
                .unwrap()
                .is_none()
        );
        assert!(
            check(&notice(NoticeKind::Generic, aws_no))
                .await
                .unwrap()
                .is_none()
        );
    }

    #[tokio::test]
    async fn poll_sends_once_when_preempted_and_survives_a_dead_endpoint() {
        let dead = notice(NoticeKind::Generic, "http://127.0.0.1:1/x".into());
        assert!(check(&dead).await.is_err());
        let url = serve("HTTP/1.1 200 OK\r\n\r\npreempt").await;
        let (tx, mut rx) = mpsc::channel(1);
        poll(
            notice(NoticeKind::Generic, url),
            Duration::from_millis(10),
            tx,
        )
        .await;
        assert!(rx.recv().await.unwrap().contains("preempt"));
    }

    #[test]
    fn malformed_responses_are_errors_not_panics() {
        for bad in [
            &b""[..],
            b"HTTP/1.1\r\n\r\n",
            b"garbage\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        ] {
            assert!(
                parse_response(bad).is_none(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
