//! AWS (IMDSv2): the spot `instance-action` and the rebalance recommendation, with a session
//! token renewed when half of its lifetime has passed; IMDSv1 only where there is no token
//! endpoint.

use std::time::Duration;

use reqwest::Url;
use serde_json::Value;
use tokio::time::Instant;

use super::http::{Answer, Bad, Http, endpoint, json, quote, request_timeout, status_bad};
use super::{Config, Notice, NoticeError};
use crate::cli::{AWS_NOTICE_URL, RebalanceAction};

/// IMDS's shortest and longest token lifetimes (the shortest is ours: a renewal per second).
const AWS_TOKEN_TTL_S_MIN: u64 = 2;
const AWS_TOKEN_TTL_S_MAX: u64 = 21_600;
/// Longest IMDSv2 token accepted.
const AWS_TOKEN_BYTES_MAX: usize = 1_024;

const AWS_TOKEN_PATH: &str = "/latest/api/token";
const AWS_REBALANCE_PATH: &str = "/latest/meta-data/events/recommendations/rebalance";
const AWS_TOKEN_TTL_HEADER: &str = "X-aws-ec2-metadata-token-ttl-seconds";
const AWS_TOKEN_HEADER: &str = "X-aws-ec2-metadata-token";

/// The IMDSv2 token PUT: `Some(token)`, or `None` when there is no token endpoint.
pub(super) fn aws_token(status: u16, body: &str) -> Result<Option<String>, Bad> {
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
pub(super) fn aws_instance_action(status: u16, body: &str) -> Result<Option<String>, Bad> {
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
pub(super) fn aws_rebalance(status: u16, body: &str) -> Result<Option<String>, Bad> {
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

pub(super) struct Aws {
    token_url: Url,
    pub(super) action_url: Url,
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
    pub(super) fn new(cfg: &Config) -> Result<Aws, NoticeError> {
        let action = endpoint(cfg.notice.url.as_str(), AWS_NOTICE_URL)?;
        let join = |path: &str| {
            action.join(path).map_err(|e| NoticeError::Protocol {
                url: action.to_string(),
                what: format!("cannot make {path} on it: {e}"),
            })
        };
        Ok(Aws {
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
        })
    }

    pub(super) async fn round(&mut self, http: &Http) -> Result<Option<Notice>, NoticeError> {
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

#[cfg(test)]
mod tests {
    use super::super::tests::{cfg, is_preempt, watch};
    use super::*;
    use crate::cli::NoticeKind;
    use crate::notice::ErrorKind;
    use services::metadata::Imds;

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
}
