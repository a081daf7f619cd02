//! The value types of the command line and their parsers: node counts, workers per node,
//! the rendezvous backend and `--rdzv-conf`, durations, the checkpoint URL and the
//! preemption notice. Each parser's error names what was wrong; clap adds the flag.

use std::time::Duration;

use clap::ValueEnum;

use super::NPROC_PER_NODE_MAX;

/// Largest `--rdzv-conf` accepted, in entries.
const RDZV_CONF_ENTRIES_MAX: usize = 64;

/// `--nnodes`: `N` or `MIN:MAX`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NNodes {
    pub min: u32,
    pub max: u32,
}

/// `--nproc-per-node`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NProc {
    Count(u32),
    /// One per GPU when GPUs are visible, else one per CPU.
    Auto,
    /// One per CPU.
    Cpu,
    /// One per GPU (an error when none is visible).
    Gpu,
}

/// `--rdzv-backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdzvBackend {
    /// etcd v3 membership (the `elastic` crate) at `--rdzv-endpoint`.
    EtcdV3,
    /// torchrun's launcher-served rendezvous: the agent on the endpoint's host serves an etcd
    /// at the endpoint, and every agent speaks etcd v3 to it.
    C10d,
    /// Fixed membership from `--nnodes N --node-rank --master-addr --master-port`.
    Static,
}

impl RdzvBackend {
    /// The spelling `--help` and messages use.
    pub fn as_str(self) -> &'static str {
        match self {
            RdzvBackend::EtcdV3 => "etcd-v3",
            RdzvBackend::C10d => "c10d",
            RdzvBackend::Static => "static",
        }
    }
}

/// `--start-method`: how torchrun's multiprocessing starts workers. elastic-run always execs
/// each worker as a new process (what `spawn` means for a script), so every value runs the
/// same way; they are accepted so that torchrun lines run unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StartMethod {
    Spawn,
    Fork,
    Forkserver,
}

/// `--event-log-handler`: torchrun's event sinks. elastic-run logs its events through its own
/// log and `--events-file`; `null` and `console` are accepted for torchrun's lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EventLogHandler {
    Null,
    Console,
}

/// `--rdzv-conf key=value,...`, in the order given.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RdzvConf(pub Vec<(String, String)>);

impl RdzvConf {
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// `--checkpoint-url`: where the `checkpoint` crate stores committed steps. A plain path is
/// a local directory; `file://`, `s3://`, `az://` (also `azure://`, `abfs://`), `gs://` and
/// `memory://` (tests) are URLs. A relative path is resolved against the working directory
/// when the agent starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointUrl(pub String);

impl CheckpointUrl {
    /// The URL to open: relative local paths made absolute.
    pub fn resolved(&self) -> std::io::Result<String> {
        let s = &self.0;
        if let Some(path) = s.strip_prefix("file://") {
            return Ok(format!("file://{}", std::path::absolute(path)?.display()));
        }
        if s.contains("://") {
            return Ok(s.clone());
        }
        Ok(format!("file://{}", std::path::absolute(s)?.display()))
    }
}

/// URL schemes `--checkpoint-url` accepts.
pub const CHECKPOINT_SCHEMES: &[&str] = &["file", "s3", "az", "azure", "abfs", "gs", "memory"];

/// `--preemption-notice`: which format to expect and where to poll.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreemptionNotice {
    pub kind: NoticeKind,
    pub url: String,
}

/// The answer format of a preemption notice endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoticeKind {
    Gcp,
    Aws,
    Azure,
    /// Any 2xx answer with a body other than empty, `FALSE` or `false` means preempted.
    Generic,
}

/// `--rebalance-action`: what an AWS rebalance recommendation does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RebalanceAction {
    /// Ask the workers for a checkpoint now, and keep training.
    Save,
    /// Drain, as on a preemption notice.
    Drain,
    /// Do not poll it.
    Ignore,
}

/// GCP metadata: `TRUE` once preempted.
pub const GCP_NOTICE_URL: &str =
    "http://metadata.google.internal/computeMetadata/v1/instance/preempted";
/// AWS IMDS: 404 until a spot interruption is scheduled.
pub const AWS_NOTICE_URL: &str = "http://169.254.169.254/latest/meta-data/spot/instance-action";
/// Azure scheduled events.
pub const AZURE_NOTICE_URL: &str =
    "http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01";

pub(super) fn parse_nnodes(s: &str) -> Result<NNodes, String> {
    let num = |p: &str| -> Result<u32, String> {
        let n: u32 = p
            .trim()
            .parse()
            .map_err(|_| format!("`{p}` is not a node count"))?;
        if n == 0 {
            return Err("node counts start at 1".into());
        }
        Ok(n)
    };
    if s.matches(':').count() > 1 {
        return Err(format!("`{s}` is not N or MIN:MAX"));
    }
    let (min, max) = match s.split_once(':') {
        Some((a, b)) => (num(a)?, num(b)?),
        None => {
            let n = num(s)?;
            (n, n)
        }
    };
    if min > max {
        return Err(format!("MIN {min} is larger than MAX {max}"));
    }
    Ok(NNodes { min, max })
}

pub(super) fn parse_nproc(s: &str) -> Result<NProc, String> {
    match s.trim() {
        "auto" => Ok(NProc::Auto),
        "cpu" => Ok(NProc::Cpu),
        "gpu" | "xpu" => Ok(NProc::Gpu),
        t => match t.parse::<u32>() {
            Ok(0) => Err("needs at least 1 worker".into()),
            Ok(n) if n > NPROC_PER_NODE_MAX => {
                Err(format!("at most {NPROC_PER_NODE_MAX} workers per node"))
            }
            Ok(n) => Ok(NProc::Count(n)),
            Err(_) => Err(format!(
                "`{t}` is not a number, `auto`, `cpu`, `gpu` or `xpu`"
            )),
        },
    }
}

pub(super) fn parse_backend(s: &str) -> Result<RdzvBackend, String> {
    match s.trim() {
        "etcd-v3" | "etcd" | "etcd_v3" => Ok(RdzvBackend::EtcdV3),
        "c10d" => Ok(RdzvBackend::C10d),
        "static" => Ok(RdzvBackend::Static),
        other => Err(format!(
            "unknown backend `{other}`: use `etcd-v3` (alias `etcd`), `c10d` or `static`"
        )),
    }
}

/// `key=value,key=value`. One pair of quotes around the whole list is dropped: torchrun's own
/// tests pass `--rdzv-conf='join_timeout=5,timeout=5'` as one argument, quotes included.
pub(crate) fn parse_rdzv_conf(s: &str) -> Result<RdzvConf, String> {
    let mut out = Vec::new();
    let t = s.trim();
    let t = ['\'', '"']
        .iter()
        .find_map(|q| t.strip_prefix(*q).and_then(|r| r.strip_suffix(*q)))
        .unwrap_or(t);
    for part in t.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| format!("`{part}` is not key=value"))?;
        if k.trim().is_empty() {
            return Err(format!("`{part}` has an empty key"));
        }
        out.push((k.trim().to_string(), v.trim().to_string()));
        if out.len() > RDZV_CONF_ENTRIES_MAX {
            return Err(format!("more than {RDZV_CONF_ENTRIES_MAX} entries"));
        }
    }
    Ok(RdzvConf(out))
}

/// A torchrun boolean flag's `PET_*` value: an integer (`0` is false, anything else true, as
/// torchrun reads it), or `true`/`false`/`yes`/`no`.
pub(super) fn parse_bool_env(s: &str) -> Result<bool, String> {
    let t = s.trim();
    if let Ok(n) = t.parse::<i64>() {
        return Ok(n != 0);
    }
    match t.to_ascii_lowercase().as_str() {
        "true" | "yes" | "on" => Ok(true),
        "false" | "no" | "off" | "" => Ok(false),
        _ => Err(format!("`{s}` is not 0/1 or true/false")),
    }
}

/// `--logs-specs`: only torchrun's `default` exists here.
pub(super) fn parse_logs_specs(s: &str) -> Result<String, String> {
    match s.trim() {
        "default" => Ok("default".into()),
        other => Err(format!(
            "unknown logs specs `{other}`: elastic-run has only `default` (torchrun's layout \
             under --log-dir)"
        )),
    }
}

/// Largest number of `--duplicate-*-filters` strings.
const FILTERS_MAX: usize = 64;

/// `--duplicate-stdout-filters`/`--duplicate-stderr-filters`: strings a line may contain.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filters(pub Vec<String>);

impl Filters {
    /// Whether `line` contains one of the strings.
    pub fn matches(&self, line: &str) -> bool {
        self.0.iter().any(|f| line.contains(f.as_str()))
    }
}

/// Comma-separated, `,,` for a literal comma, empty strings dropped.
pub(super) fn parse_filters(s: &str) -> Result<Filters, String> {
    const PLACEHOLDER: char = '\u{0}';
    let items: Vec<String> = s
        .replace(",,", &PLACEHOLDER.to_string())
        .split(',')
        .map(|i| i.replace(PLACEHOLDER, ","))
        .filter(|i| !i.is_empty())
        .collect();
    if items.len() > FILTERS_MAX {
        return Err(format!("more than {FILTERS_MAX} filters"));
    }
    Ok(Filters(items))
}

/// `--signals-to-handle`: signal numbers, in the order given, and the list as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signals {
    pub numbers: Vec<i32>,
    /// The names, comma-separated (`TORCHELASTIC_SIGNALS_TO_HANDLE`).
    pub names: String,
}

/// Signals the agent can handle by name.
const HANDLED_SIGNALS: &[(&str, i32)] = &[
    ("SIGTERM", libc::SIGTERM),
    ("SIGINT", libc::SIGINT),
    ("SIGHUP", libc::SIGHUP),
    ("SIGQUIT", libc::SIGQUIT),
    ("SIGUSR1", libc::SIGUSR1),
    ("SIGUSR2", libc::SIGUSR2),
];

pub(super) fn parse_signals(s: &str) -> Result<Signals, String> {
    let mut numbers = Vec::new();
    let mut names = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let upper = part.to_ascii_uppercase();
        let name = if upper.starts_with("SIG") {
            upper
        } else {
            format!("SIG{upper}")
        };
        let Some((n, num)) = HANDLED_SIGNALS.iter().find(|(n, _)| *n == name) else {
            return Err(format!(
                "`{part}` is not one of {}",
                HANDLED_SIGNALS
                    .iter()
                    .map(|(n, _)| *n)
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        };
        if !numbers.contains(num) {
            numbers.push(*num);
            names.push(*n);
        }
    }
    if numbers.is_empty() {
        return Err("needs at least one signal".into());
    }
    Ok(Signals {
        numbers,
        names: names.join(","),
    })
}

/// Seconds (`30`, `0.5`) or a number with a unit: `ms`, `s`, `m`, `h`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a duration (try `30`, `30s`, `2m`, `500ms`)"))?;
    let secs = match unit.trim() {
        "" | "s" => value,
        "ms" => value / 1000.0,
        "m" | "min" => value * 60.0,
        "h" => value * 3600.0,
        u => return Err(format!("unknown unit `{u}` in `{s}` (use ms, s, m or h)")),
    };
    // Bound it: a week is longer than any grace or timeout that makes sense.
    if !secs.is_finite() || !(0.0..=7.0 * 86_400.0).contains(&secs) {
        return Err(format!("`{s}` is out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

pub(super) fn parse_positive_duration(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d.is_zero() {
        return Err("must be longer than 0".into());
    }
    Ok(d)
}

/// `--checkpoint-keep-last`: at least 1, since retention never deletes the newest good step.
pub(super) fn parse_keep_last(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1: retention always keeps the newest committed step".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

pub(super) fn parse_positive_f64(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("`{s}` is not a positive number")),
    }
}

pub(super) fn parse_checkpoint_url(s: &str) -> Result<CheckpointUrl, String> {
    let t = s.trim();
    if t.is_empty() {
        return Err("empty checkpoint location".into());
    }
    if let Some((scheme, rest)) = t.split_once("://") {
        if !CHECKPOINT_SCHEMES.contains(&scheme) {
            return Err(format!(
                "unknown scheme `{scheme}://`: use a directory, or one of {}",
                CHECKPOINT_SCHEMES
                    .iter()
                    .map(|s| format!("{s}://"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        if rest.is_empty() && scheme != "memory" {
            return Err(format!("`{scheme}://` needs a bucket or path"));
        }
    }
    Ok(CheckpointUrl(t.to_string()))
}

/// `gcp`, `aws`, `azure` (their metadata URLs), `KIND=http://...` (that format at another
/// URL, e.g. a test server), or `http://...` (generic format).
pub(super) fn parse_notice(s: &str) -> Result<PreemptionNotice, String> {
    let t = s.trim();
    let (kind, url) = match t.split_once('=') {
        Some((k, u)) if !k.contains('/') => (k, Some(u)),
        _ => (t, None),
    };
    let (kind, default) = match kind {
        "gcp" => (NoticeKind::Gcp, GCP_NOTICE_URL),
        "aws" => (NoticeKind::Aws, AWS_NOTICE_URL),
        "azure" => (NoticeKind::Azure, AZURE_NOTICE_URL),
        u if u.starts_with("http://") && url.is_none() => (NoticeKind::Generic, u),
        u if u.starts_with("https://") => {
            return Err(
                "https notice URLs are not supported (metadata services speak plain http)".into(),
            );
        }
        u => return Err(format!("`{u}` is not gcp, aws, azure or an http:// URL")),
    };
    let url = url.unwrap_or(default);
    if !url.starts_with("http://") {
        return Err(format!("`{url}` is not an http:// URL"));
    }
    Ok(PreemptionNotice {
        kind,
        url: url.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nnodes_accepts_single_and_range_and_rejects_inverted() {
        assert_eq!(parse_nnodes("3").unwrap(), NNodes { min: 3, max: 3 });
        assert_eq!(parse_nnodes("2:8").unwrap(), NNodes { min: 2, max: 8 });
        assert!(parse_nnodes("8:2").is_err());
        assert!(parse_nnodes("0").is_err());
        assert!(parse_nnodes("a:2").is_err());
        let e = parse_nnodes("2:20:30").unwrap_err();
        assert!(e.contains("2:20:30") && e.contains("MIN:MAX"), "{e}");
    }

    #[test]
    fn rdzv_conf_drops_one_pair_of_quotes_around_the_list() {
        let c = parse_rdzv_conf("'join_timeout=5,last_call_timeout=1,timeout=5'").unwrap();
        assert_eq!(c.get("join_timeout"), Some("5"));
        assert_eq!(c.get("timeout"), Some("5"));
        assert_eq!(
            parse_rdzv_conf("\"timeout=5\"").unwrap().get("timeout"),
            Some("5")
        );
        assert!(parse_rdzv_conf("'timeout").is_err());
        assert_eq!(parse_backend("c10d"), Ok(RdzvBackend::C10d));
        let e = parse_backend("zookeeper").unwrap_err();
        assert!(e.contains("zookeeper") && e.contains("c10d"), "{e}");
    }

    #[test]
    fn torchrun_booleans_filters_and_signals_parse() {
        assert_eq!(parse_bool_env("0"), Ok(false));
        assert_eq!(parse_bool_env("1"), Ok(true));
        assert_eq!(parse_bool_env("2"), Ok(true));
        assert_eq!(parse_bool_env("False"), Ok(false));
        assert!(parse_bool_env("maybe").unwrap_err().contains("maybe"));
        assert_eq!(parse_logs_specs("default").unwrap(), "default");
        assert!(
            parse_logs_specs("DOESNOT_EXIST")
                .unwrap_err()
                .contains("DOESNOT_EXIST")
        );
        let f = parse_filters("NCCL,,x,loss").unwrap();
        assert_eq!(f.0, vec!["NCCL,x".to_string(), "loss".into()]);
        assert!(f.matches("step 3 loss 0.1") && !f.matches("step 3"));
        assert!(parse_filters("").unwrap().0.is_empty());
        let s = parse_signals("SIGTERM, sigint,HUP,SIGTERM").unwrap();
        assert_eq!(s.numbers, vec![libc::SIGTERM, libc::SIGINT, libc::SIGHUP]);
        assert_eq!(s.names, "SIGTERM,SIGINT,SIGHUP");
        assert!(parse_signals("SIGKILL").unwrap_err().contains("SIGKILL"));
        assert!(parse_signals("").is_err());
    }

    #[test]
    fn durations_take_plain_seconds_and_units() {
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("0.1").unwrap(), Duration::from_millis(100));
        assert!(parse_duration("30x").is_err());
        assert!(parse_duration("-1").is_err());
        assert!(parse_duration("").is_err());
        assert!(parse_duration("1e300").is_err());
    }

    #[test]
    fn checkpoint_urls_resolve_and_notices_parse() {
        assert_eq!(
            parse_checkpoint_url("s3://b/job")
                .unwrap()
                .resolved()
                .unwrap(),
            "s3://b/job"
        );
        assert!(
            parse_checkpoint_url("rel/dir")
                .unwrap()
                .resolved()
                .unwrap()
                .starts_with("file:///")
        );
        let aws = parse_notice("aws=http://127.0.0.1:9/latest").unwrap();
        assert_eq!(
            (aws.kind, aws.url.as_str()),
            (NoticeKind::Aws, "http://127.0.0.1:9/latest")
        );
        assert_eq!(parse_notice("gcp").unwrap().url, GCP_NOTICE_URL);
        assert!(parse_notice("gcp=ftp://x").is_err());
    }
}
