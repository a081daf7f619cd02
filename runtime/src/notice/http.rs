//! What every watch shares: the HTTP client the metadata services are spoken to with, and
//! the reading of an answer that is neither a notice nor "no notice" ([`Bad`]).

use std::time::Duration;

use reqwest::header::ETAG;
use reqwest::{Client, Url};
use serde_json::Value;

use super::{NoticeError, REQUEST_TIMEOUT_MS, RESPONSE_BYTES_MAX};

/// Connecting alone (the service is link-local: it answers at once or not at all).
const CONNECT_TIMEOUT_MS: u64 = 1_000;
/// Longest piece of an answer quoted in a reason or an error.
pub(super) const QUOTE_BYTES_MAX: usize = 200;

/// An answer that is not a notice and not "no notice".
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Bad {
    /// 400, 401, 403.
    Refused,
    Unexpected(String),
}

impl Bad {
    pub(super) fn at(self, url: &Url, a: &Answer) -> NoticeError {
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

pub(super) fn status_bad(status: u16) -> Bad {
    match status {
        400 | 401 | 403 => Bad::Refused,
        s => Bad::Unexpected(format!("unexpected status {s}")),
    }
}

pub(super) fn json(body: &str, what: &str) -> Result<Value, Bad> {
    serde_json::from_str(body)
        .map_err(|e| Bad::Unexpected(format!("{what} is not JSON ({e}): {:?}", quote(body))))
}

/// At most [`QUOTE_BYTES_MAX`] bytes of `s`, cut at a character boundary.
pub(super) fn quote(s: &str) -> &str {
    let mut end = s.len().min(QUOTE_BYTES_MAX);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

pub(super) fn request_timeout() -> Duration {
    Duration::from_millis(REQUEST_TIMEOUT_MS)
}

pub(super) struct Http {
    pub(super) client: Client,
}

/// A status, the `ETag`, and at most [`RESPONSE_BYTES_MAX`] bytes of body.
pub(super) struct Answer {
    pub(super) status: u16,
    pub(super) etag: Option<String>,
    pub(super) body: String,
}

impl Http {
    pub(super) fn new(url: &Url) -> Result<Http, NoticeError> {
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

    pub(super) async fn send(
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
pub(super) fn chain(e: &dyn std::error::Error) -> String {
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
pub(super) fn endpoint(given: &str, default: &str) -> Result<Url, NoticeError> {
    let mut url = Url::parse(given).map_err(|e| not_a_url(given, e))?;
    if url.path() == "/" && url.query().is_none() {
        let d = Url::parse(default).map_err(|e| not_a_url(default, e))?;
        url.set_path(d.path());
        url.set_query(d.query());
    }
    Ok(url)
}

pub(super) fn not_a_url(url: &str, e: impl std::fmt::Display) -> NoticeError {
    NoticeError::Protocol {
        url: url.to_string(),
        what: format!("not a URL: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{AWS_NOTICE_URL, AZURE_NOTICE_URL, GCP_NOTICE_URL};

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
