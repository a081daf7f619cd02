//! The command line: torchrun's flags with torchrun's spelling, plus elastic-run's own.
//!
//! Every torchrun flag also reads `PET_<FLAG>` (Kubeflow's PyTorchJob sets them), and accepts
//! torchrun's underscore spelling (`--nproc_per_node`). Values clap cannot check itself are
//! parsed by `value_parser` functions here, so a bad value is a usage error (exit 2) with a
//! message naming the flag, exactly like an unknown flag.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};

/// Default `--max-restarts` (torchrun's default is 0).
pub const MAX_RESTARTS_DEFAULT: u32 = 0;
/// Default `--monitor-interval`: how often worker state and the hang watchdog are checked.
pub const MONITOR_INTERVAL_DEFAULT: &str = "0.1s";
/// Default `--preemption-grace`: cloud Spot notices give 30 s (GCP, Azure) to 120 s (AWS).
pub const PREEMPTION_GRACE_DEFAULT: &str = "30s";
/// Default `--startup-timeout`.
pub const STARTUP_TIMEOUT_DEFAULT: &str = "10m";
/// Default `--checkpoint-interval` in steps; 0 means interval checkpoints are off.
pub const CHECKPOINT_INTERVAL_DEFAULT: u64 = 0;
/// Default `--checkpoint-keep-last`: committed steps retention keeps.
pub const CHECKPOINT_KEEP_LAST_DEFAULT: usize = crate::store_sink::KEEP_STEPS_DEFAULT;
/// Default `--role`, torchrun's.
pub const ROLE_DEFAULT: &str = "default";
/// Default `--rdzv-id`, torchrun's.
pub const RDZV_ID_DEFAULT: &str = "none";
/// Default master port in static mode, torchrun's.
pub const MASTER_PORT_DEFAULT: u16 = 29500;
/// Default local checkpoint directory (made into a `file://` URL).
pub const CHECKPOINT_DIR_DEFAULT: &str = "./elastic-checkpoints";
/// Default staging root; a per-job, per-node directory is made below it.
pub const STAGING_ROOT_DEFAULT: &str = "/dev/shm/elastic-run";
/// Largest `--nproc-per-node` accepted: a bound on processes and pipes per agent.
pub const NPROC_PER_NODE_MAX: u32 = 1024;
/// Largest `--rdzv-conf` accepted, in entries.
const RDZV_CONF_ENTRIES_MAX: usize = 64;

/// `elastic-run`: a drop-in for `torchrun` that keeps data-parallel training going on
/// preemptible machines.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "elastic-run",
    version,
    after_help = "Examples:\n  elastic-run --standalone --nproc-per-node 2 -- python train.py\n  \
                  elastic-run --nproc-per-node 2 train.py --lr 0.1   (torchrun style)"
)]
pub struct Cli {
    /// Number of nodes, `N` or `MIN:MAX`.
    #[arg(long, env = "PET_NNODES", default_value = "1:1", value_parser = parse_nnodes)]
    pub nnodes: NNodes,

    /// Workers per node: a number, `auto` (one per GPU, else per CPU), `cpu` or `gpu`.
    #[arg(long = "nproc-per-node", alias = "nproc_per_node", env = "PET_NPROC_PER_NODE",
          default_value = "1", value_parser = parse_nproc)]
    pub nproc_per_node: NProc,

    /// Rendezvous backend: `etcd-v3` (alias `etcd`), `static`; `c10d` is refused.
    #[arg(long = "rdzv-backend", alias = "rdzv_backend", env = "PET_RDZV_BACKEND",
          default_value = "static", value_parser = parse_backend)]
    pub rdzv_backend: RdzvBackend,

    /// Rendezvous endpoint, `host:port` of etcd.
    #[arg(
        long = "rdzv-endpoint",
        alias = "rdzv_endpoint",
        env = "PET_RDZV_ENDPOINT",
        default_value = ""
    )]
    pub rdzv_endpoint: String,

    /// Job id shared by every node of the job.
    #[arg(long = "rdzv-id", alias = "rdzv_id", env = "PET_RDZV_ID", default_value = RDZV_ID_DEFAULT)]
    pub rdzv_id: String,

    /// Extra rendezvous settings, `key=value,key=value`: timing and join policy, and how to
    /// reach etcd (torchrun's `protocol=https`, `cacert=PATH`, `cert=PATH`, `key=PATH`). etcd's
    /// user and password come from `ELASTIC_ETCD_USERNAME` and `ELASTIC_ETCD_PASSWORD`, or
    /// etcdctl's `ETCDCTL_USER=user:password`.
    #[arg(long = "rdzv-conf", alias = "rdzv_conf", env = "PET_RDZV_CONF", default_value = "",
          value_parser = parse_rdzv_conf)]
    pub rdzv_conf: RdzvConf,

    /// Standalone: one node, no rendezvous service (`--nnodes 1`, local master).
    #[arg(long, env = "PET_STANDALONE")]
    pub standalone: bool,

    /// Restarts of the worker group after a failure before the job fails.
    #[arg(long = "max-restarts", alias = "max_restarts", env = "PET_MAX_RESTARTS",
          default_value_t = MAX_RESTARTS_DEFAULT)]
    pub max_restarts: u32,

    /// How often the agent checks its workers (seconds, or `500ms`, `2s`).
    #[arg(long = "monitor-interval", alias = "monitor_interval", env = "PET_MONITOR_INTERVAL",
          default_value = MONITOR_INTERVAL_DEFAULT, value_parser = parse_duration)]
    pub monitor_interval: Duration,

    /// Worker role name (ROLE_NAME).
    #[arg(long, env = "PET_ROLE", default_value = ROLE_DEFAULT)]
    pub role: String,

    /// Master address for static rendezvous.
    #[arg(
        long = "master-addr",
        alias = "master_addr",
        env = "PET_MASTER_ADDR",
        default_value = "127.0.0.1"
    )]
    pub master_addr: String,

    /// Master port for static rendezvous; standalone picks a free port when unset.
    #[arg(long = "master-port", alias = "master_port", env = "PET_MASTER_PORT")]
    pub master_port: Option<u16>,

    /// This node's rank for static rendezvous.
    #[arg(
        long = "node-rank",
        alias = "node_rank",
        env = "PET_NODE_RANK",
        default_value_t = 0
    )]
    pub node_rank: u32,

    /// Run CMD as a Python module (`python -m CMD`).
    #[arg(short = 'm', long = "module", env = "PET_MODULE", conflicts_with_all = ["no_python", "run_path"])]
    pub module: bool,

    /// Execute CMD directly, without prepending the Python interpreter.
    #[arg(
        long = "no-python",
        alias = "no_python",
        env = "PET_NO_PYTHON",
        conflicts_with = "run_path"
    )]
    pub no_python: bool,

    /// Run CMD as a Python script path (the default for a `*.py` CMD).
    #[arg(long = "run-path", alias = "run_path", env = "PET_RUN_PATH")]
    pub run_path: bool,

    /// The Python interpreter used for script and module mode.
    #[arg(long, env = "ELASTIC_PYTHON", default_value = "python3")]
    pub python: String,

    /// Where checkpoints go: `file://DIR` or a plain directory.
    #[arg(long = "checkpoint-url", env = "ELASTIC_CHECKPOINT_URL", default_value = CHECKPOINT_DIR_DEFAULT,
          value_parser = parse_checkpoint_url)]
    pub checkpoint_url: CheckpointUrl,

    /// Chunk compression of checkpoints: `auto` compresses on remote object stores (s3, az,
    /// gs) and not on a local directory, where it costs more CPU than the bytes it saves.
    #[arg(long = "checkpoint-compress", env = "ELASTIC_CHECKPOINT_COMPRESS", value_enum,
          default_value_t = checkpoint::Compression::Auto)]
    pub checkpoint_compress: checkpoint::Compression,

    /// An option of the checkpoint store, `KEY=VALUE` with object_store's key names for the
    /// URL's scheme (`aws_endpoint`, `aws_region`, `timeout`, `azure_storage_account_name`,
    /// `google_service_account`, ...), applied over the environment (`AWS_*`, ...). Repeatable;
    /// a comma before another `KEY=` starts the next option, so the environment variable (read
    /// when the flag is not given) takes a comma-separated list. Values are never printed.
    #[arg(long = "checkpoint-store-option", env = "ELASTIC_CHECKPOINT_STORE_OPTIONS",
          value_name = "KEY=VALUE", hide_env_values = true, value_parser = StoreOptionsParser)]
    pub checkpoint_store_option: Vec<StoreOptionList>,

    /// Checkpoint every N steps (0: only on drain and when workers decide).
    #[arg(long = "checkpoint-interval", env = "ELASTIC_CHECKPOINT_INTERVAL",
          default_value_t = CHECKPOINT_INTERVAL_DEFAULT)]
    pub checkpoint_interval: u64,

    /// Also checkpoint every this long (`10m`): the agent asks for the next step, and every
    /// worker agrees on it through `should_stop`.
    #[arg(long = "checkpoint-every", env = "ELASTIC_CHECKPOINT_EVERY", value_parser = parse_positive_duration)]
    pub checkpoint_every: Option<Duration>,

    /// Retention after each commit keeps the newest K committed steps that pass its check
    /// (at least 1; a newer step that does not pass is kept too, and does not count).
    #[arg(long = "checkpoint-keep-last", env = "ELASTIC_CHECKPOINT_KEEP_LAST",
          default_value_t = CHECKPOINT_KEEP_LAST_DEFAULT, value_parser = parse_keep_last)]
    pub checkpoint_keep_last: usize,

    /// Retention also keeps every committed step divisible by N.
    #[arg(long = "checkpoint-keep-every", env = "ELASTIC_CHECKPOINT_KEEP_EVERY",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub checkpoint_keep_every: Option<u64>,

    /// How the learning rate follows the world size.
    #[arg(long = "lr-scaling", env = "ELASTIC_LR_SCALING", value_enum, default_value_t = LrScaling::None)]
    pub lr_scaling: LrScaling,

    /// World size the base LR and batch were tuned for (default: the first world size).
    #[arg(long = "base-world-size", env = "ELASTIC_BASE_WORLD_SIZE", value_parser = clap::value_parser!(u32).range(1..))]
    pub base_world_size: Option<u32>,

    /// Per-worker batch size.
    #[arg(long = "batch-size", env = "ELASTIC_BATCH_SIZE", value_parser = clap::value_parser!(u64).range(1..))]
    pub batch_size: Option<u64>,

    /// Global batch to keep constant under `--lr-scaling fixed` (default: batch x base world).
    #[arg(long = "global-batch", env = "ELASTIC_GLOBAL_BATCH", value_parser = clap::value_parser!(u64).range(1..))]
    pub global_batch: Option<u64>,

    /// Base learning rate, scaled into ELASTIC_LR.
    #[arg(long = "base-lr", env = "ELASTIC_BASE_LR", value_parser = parse_positive_f64)]
    pub base_lr: Option<f64>,

    /// LR warm-up steps after a rescale.
    #[arg(
        long = "warmup-steps",
        env = "ELASTIC_WARMUP_STEPS",
        default_value_t = 0
    )]
    pub warmup_steps: u64,

    /// Time the workers get to save and exit on SIGTERM or a preemption notice.
    #[arg(long = "preemption-grace", env = "ELASTIC_PREEMPTION_GRACE",
          default_value = PREEMPTION_GRACE_DEFAULT, value_parser = parse_duration)]
    pub preemption_grace: Duration,

    /// Cloud preemption notice to watch: `gcp`, `aws`, `azure` (their metadata services),
    /// `KIND=http://HOST:PORT[/PATH]` (that service elsewhere), or an `http://` URL.
    #[arg(long = "preemption-notice", env = "ELASTIC_PREEMPTION_NOTICE", value_parser = parse_notice)]
    pub preemption_notice: Option<PreemptionNotice>,

    /// What an AWS rebalance recommendation does: `save` (checkpoint now and keep training),
    /// `drain` (leave, as on a preemption notice) or `ignore`.
    #[arg(long = "rebalance-action", env = "ELASTIC_REBALANCE_ACTION", value_enum,
          default_value_t = RebalanceAction::Save)]
    pub rebalance_action: RebalanceAction,

    /// This VM's name: only Azure scheduled events that name it count (default: every
    /// `Preempt` or `Terminate` event).
    #[arg(long = "azure-vm-name", env = "ELASTIC_AZURE_VM_NAME")]
    pub azure_vm_name: Option<String>,

    /// Node-local staging directory for snapshots (default under /dev/shm).
    #[arg(long = "staging-dir", env = "ELASTIC_STAGING_DIR")]
    pub staging_dir: Option<PathBuf>,

    /// Serve Prometheus metrics on this address (`127.0.0.1:9400`).
    #[arg(long = "metrics-addr", env = "ELASTIC_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,

    /// This node's id (default: hostname and PID).
    #[arg(long = "node-id", env = "ELASTIC_NODE_ID")]
    pub node_id: Option<String>,

    /// Restart the workers when none reports progress (`elastic_run.report_progress`) for this
    /// long once they started reporting. Off by default; workers that never report must not
    /// set it.
    #[arg(long = "hang-timeout", env = "ELASTIC_HANG_TIMEOUT", value_parser = parse_positive_duration)]
    pub hang_timeout: Option<Duration>,

    /// With `--hang-timeout`: how long a worker group may take to report its first step
    /// (imports, process-group set-up, restore) before it counts as hung.
    #[arg(long = "startup-timeout", env = "ELASTIC_STARTUP_TIMEOUT", default_value = STARTUP_TIMEOUT_DEFAULT,
          value_parser = parse_positive_duration)]
    pub startup_timeout: Duration,

    /// Logs as JSON lines.
    #[arg(long, env = "ELASTIC_JSON")]
    pub json: bool,

    /// Address other nodes reach this node at (torchrun's `--local-addr`); rank 0's becomes
    /// `MASTER_ADDR`. Default: this host's name when it resolves, else 127.0.0.1.
    #[arg(long = "local-addr", alias = "local_addr", env = "PET_LOCAL_ADDR")]
    pub local_addr: Option<String>,

    /// Append one JSON line per agent event (generations, commits, drains, failures) here.
    #[arg(long = "events-file", env = "ELASTIC_EVENTS_FILE")]
    pub events_file: Option<PathBuf>,

    /// Under `--lr-scaling fixed`, when the global batch cannot be split exactly over the
    /// world: use the nearest valid configuration (and say so), or refuse.
    #[arg(long = "indivisible-batch", env = "ELASTIC_INDIVISIBLE_BATCH", value_enum,
          default_value_t = IndivisibleBatch::Nearest)]
    pub indivisible_batch: IndivisibleBatch,

    /// The training command and its arguments (after `--`, or a `*.py` script torchrun-style).
    #[arg(required = true, trailing_var_arg = true, value_name = "CMD")]
    pub cmd: Vec<String>,
}

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
    /// etcd v3 membership (the `elastic` crate).
    EtcdV3,
    /// Fixed membership from `--nnodes N --node-rank --master-addr --master-port`.
    Static,
}

impl Cli {
    /// Every `--checkpoint-store-option` (or `ELASTIC_CHECKPOINT_STORE_OPTIONS` entry), keys in
    /// lower case, in the order given.
    pub fn store_options(&self) -> Vec<(String, String)> {
        self.checkpoint_store_option
            .iter()
            .flat_map(|l| l.0.iter().cloned())
            .collect()
    }
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

/// `--lr-scaling`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LrScaling {
    /// LR x W/W0.
    Linear,
    /// LR x sqrt(W/W0).
    Sqrt,
    /// LR untouched.
    None,
    /// Keep the global batch: grad accumulation changes, LR untouched.
    Fixed,
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

/// One `--checkpoint-store-option` value: object_store configuration keys (lower case) and
/// their values. `Debug` shows the keys only: values may be credentials.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct StoreOptionList(pub Vec<(String, String)>);

impl std::fmt::Debug for StoreOptionList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|(k, _)| k))
            .finish()
    }
}

/// Largest number of options one `--checkpoint-store-option` value may hold.
const STORE_OPTIONS_MAX: usize = 64;

/// Whether object_store knows `key` (lower case) for the store of `scheme`; `None` for a
/// scheme whose store takes no options (`file`, `memory`).
pub fn store_option_known(scheme: &str, key: &str) -> Option<bool> {
    use std::str::FromStr;
    match scheme {
        "s3" | "s3a" => Some(object_store::aws::AmazonS3ConfigKey::from_str(key).is_ok()),
        "az" | "azure" | "abfs" | "abfss" => {
            Some(object_store::azure::AzureConfigKey::from_str(key).is_ok())
        }
        "gs" => Some(object_store::gcp::GoogleConfigKey::from_str(key).is_ok()),
        _ => None,
    }
}

/// Checks `--checkpoint-store-option` against the store `url` opens: every key must be one of
/// that backend's, and `file://` and `memory://` stores take none. Names keys, never values.
pub fn check_store_options(url: &str, options: &[(String, String)]) -> Result<(), String> {
    let Some((k, _)) = options.first() else {
        return Ok(());
    };
    let scheme = url.split_once("://").map_or("file", |(s, _)| s);
    for (key, _) in options {
        match store_option_known(scheme, key) {
            Some(true) => {}
            Some(false) => {
                return Err(format!(
                    "`{key}` is not an option of {scheme}:// stores (object_store's {} names)",
                    match scheme {
                        "s3" | "s3a" => "AmazonS3ConfigKey",
                        "gs" => "GoogleConfigKey",
                        _ => "AzureConfigKey",
                    }
                ));
            }
            None => {
                return Err(format!(
                    "`{k}` given, but {scheme}:// stores take no options (they are for s3://, \
                     az:// and gs://)"
                ));
            }
        }
    }
    Ok(())
}

/// `KEY=VALUE[,KEY=VALUE...]`: a comma followed by something other than `KEY=` belongs to the
/// value before it. Each key must be an object_store option of some backend (S3, Azure, GCS);
/// the URL's own backend is checked at start-up ([`check_store_options`]).
fn parse_store_options(s: &str) -> Result<StoreOptionList, String> {
    let key_like = |k: &str| {
        !k.is_empty()
            && k.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    };
    let mut out: Vec<(String, String)> = Vec::new();
    for part in s.split(',').filter(|p| !p.trim().is_empty()) {
        match part.split_once('=') {
            Some((k, v)) if key_like(k.trim()) => {
                out.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
            }
            _ => match out.last_mut() {
                Some((_, v)) => {
                    v.push(',');
                    v.push_str(part.trim_end());
                }
                // Not echoed: it may be a credential given without its key.
                None => return Err("expected KEY=VALUE (object_store option names)".into()),
            },
        }
        if out.len() > STORE_OPTIONS_MAX {
            return Err(format!("more than {STORE_OPTIONS_MAX} options"));
        }
    }
    for (k, _) in &out {
        let known = ["s3", "az", "gs"]
            .iter()
            .any(|scheme| store_option_known(scheme, k) == Some(true));
        if !known {
            return Err(format!(
                "unknown store option `{k}`: use object_store's names for S3 (`aws_endpoint`, \
                 `aws_region`, ...), Azure (`azure_storage_account_name`, ...) or GCS \
                 (`google_service_account`, ...), or a client option (`timeout`, \
                 `connect_timeout`, `allow_http`, ...)"
            ));
        }
    }
    Ok(StoreOptionList(out))
}

/// clap's parser for `--checkpoint-store-option`: [`parse_store_options`], with errors that do
/// not echo the value given (clap's own would), since values may be credentials.
#[derive(Clone, Copy, Debug)]
pub struct StoreOptionsParser;

impl clap::builder::TypedValueParser for StoreOptionsParser {
    type Value = StoreOptionList;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<StoreOptionList, clap::Error> {
        let fail = |kind, why: String| {
            clap::Error::raw(kind, format!("--checkpoint-store-option: {why}\n")).with_cmd(cmd)
        };
        let s = value
            .to_str()
            .ok_or_else(|| fail(clap::error::ErrorKind::InvalidUtf8, "not UTF-8".into()))?;
        parse_store_options(s).map_err(|e| fail(clap::error::ErrorKind::ValueValidation, e))
    }
}

/// URL schemes `--checkpoint-url` accepts.
pub const CHECKPOINT_SCHEMES: &[&str] = &["file", "s3", "az", "azure", "abfs", "gs", "memory"];

/// `--indivisible-batch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum IndivisibleBatch {
    Nearest,
    Refuse,
}

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

fn parse_nnodes(s: &str) -> Result<NNodes, String> {
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

fn parse_nproc(s: &str) -> Result<NProc, String> {
    match s.trim() {
        "auto" => Ok(NProc::Auto),
        "cpu" => Ok(NProc::Cpu),
        "gpu" => Ok(NProc::Gpu),
        t => match t.parse::<u32>() {
            Ok(0) => Err("needs at least 1 worker".into()),
            Ok(n) if n > NPROC_PER_NODE_MAX => {
                Err(format!("at most {NPROC_PER_NODE_MAX} workers per node"))
            }
            Ok(n) => Ok(NProc::Count(n)),
            Err(_) => Err(format!("`{t}` is not a number, `auto`, `cpu` or `gpu`")),
        },
    }
}

fn parse_backend(s: &str) -> Result<RdzvBackend, String> {
    match s.trim() {
        "etcd-v3" | "etcd" | "etcd_v3" => Ok(RdzvBackend::EtcdV3),
        "static" => Ok(RdzvBackend::Static),
        "c10d" => Err(
            "`c10d` rendezvous is not supported: use `etcd-v3` for elastic jobs, or \
                       `static` (--master-addr/--master-port/--node-rank) for a fixed set of nodes"
                .into(),
        ),
        other => Err(format!(
            "unknown backend `{other}`: use `etcd-v3` or `static`"
        )),
    }
}

pub(crate) fn parse_rdzv_conf(s: &str) -> Result<RdzvConf, String> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
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

fn parse_positive_duration(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d.is_zero() {
        return Err("must be longer than 0".into());
    }
    Ok(d)
}

/// `--checkpoint-keep-last`: at least 1, since retention never deletes the newest good step.
fn parse_keep_last(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1: retention always keeps the newest committed step".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn parse_positive_f64(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("`{s}` is not a positive number")),
    }
}

fn parse_checkpoint_url(s: &str) -> Result<CheckpointUrl, String> {
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
fn parse_notice(s: &str) -> Result<PreemptionNotice, String> {
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

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("elastic-run").chain(args.iter().copied()))
    }

    #[test]
    fn nnodes_accepts_single_and_range_and_rejects_inverted() {
        assert_eq!(parse_nnodes("3").unwrap(), NNodes { min: 3, max: 3 });
        assert_eq!(parse_nnodes("2:8").unwrap(), NNodes { min: 2, max: 8 });
        assert!(parse_nnodes("8:2").is_err());
        assert!(parse_nnodes("0").is_err());
        assert!(parse_nnodes("a:2").is_err());
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
    fn torchrun_underscore_spellings_parse() {
        let cli = parse(&[
            "--nproc_per_node",
            "4",
            "--max_restarts=2",
            "--rdzv_endpoint",
            "h:2379",
            "--rdzv_backend",
            "etcd",
            "--node_rank",
            "1",
            "--master_port",
            "1234",
            "train.py",
        ])
        .unwrap();
        assert_eq!(cli.nproc_per_node, NProc::Count(4));
        assert_eq!(cli.max_restarts, 2);
        assert_eq!(cli.rdzv_endpoint, "h:2379");
        assert_eq!(cli.rdzv_backend, RdzvBackend::EtcdV3);
        assert_eq!(cli.node_rank, 1);
        assert_eq!(cli.master_port, Some(1234));
        assert_eq!(cli.cmd, vec!["train.py"]);
    }

    #[test]
    fn command_after_double_dash_keeps_its_own_flags() {
        let cli = parse(&[
            "--standalone",
            "--",
            "python",
            "train.py",
            "--lr",
            "0.1",
            "--nnodes",
            "x",
        ])
        .unwrap();
        assert!(cli.standalone);
        assert_eq!(
            cli.cmd,
            vec!["python", "train.py", "--lr", "0.1", "--nnodes", "x"]
        );
        assert_eq!(cli.nnodes, NNodes { min: 1, max: 1 });
    }

    #[test]
    fn bad_values_are_usage_errors() {
        for args in [
            &["--nnodes", "4:2", "x.py"][..],
            &["--nproc-per-node", "many", "x.py"],
            &["--nproc-per-node", "0", "x.py"],
            &["--rdzv-backend", "c10d", "x.py"],
            &["--lr-scaling", "cubic", "x.py"],
            &["--preemption-grace", "soon", "x.py"],
            &["--preemption-notice", "ftp://x", "x.py"],
            &["--rebalance-action", "panic", "x.py"],
            &["--checkpoint-url", "ftp://bucket/job", "x.py"],
            &["--checkpoint-url", "s3://", "x.py"],
            &["--indivisible-batch", "round", "x.py"],
            &["--rdzv-conf", "novalue", "x.py"],
            &["--base-world-size", "0", "x.py"],
            &["--base-lr", "-1", "x.py"],
            &["--no-python", "-m", "x"],
            &["--standalone"],
            &["--bogus", "x.py"],
            &["--hang-timeout", "0", "x.py"],
            &["--checkpoint-every", "0s", "x.py"],
        ] {
            let err = parse(args).expect_err(&format!("{args:?} should fail"));
            assert_eq!(err.exit_code(), 2, "{args:?}: {err}");
        }
    }

    #[test]
    fn checkpoint_retention_flags_parse_and_keep_last_0_is_refused() {
        let cli = parse(&["x.py"]).unwrap();
        assert_eq!(cli.checkpoint_keep_last, CHECKPOINT_KEEP_LAST_DEFAULT);
        assert_eq!(cli.checkpoint_keep_every, None);
        let cli = parse(&[
            "--checkpoint-keep-last",
            "1",
            "--checkpoint-keep-every=500",
            "x.py",
        ])
        .unwrap();
        assert_eq!(cli.checkpoint_keep_last, 1);
        assert_eq!(cli.checkpoint_keep_every, Some(500));
        let err = parse(&["--checkpoint-keep-last", "0", "x.py"]).unwrap_err();
        assert_eq!(err.exit_code(), 2, "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("--checkpoint-keep-last") && msg.contains("at least 1"),
            "{msg}"
        );
        for args in [
            &["--checkpoint-keep-last", "-1", "x.py"][..],
            &["--checkpoint-keep-last", "many", "x.py"],
            &["--checkpoint-keep-every", "0", "x.py"],
        ] {
            let err = parse(args).expect_err(&format!("{args:?} should fail"));
            assert_eq!(err.exit_code(), 2, "{args:?}: {err}");
        }
    }

    #[test]
    fn c10d_backend_message_names_the_alternatives() {
        let err = parse(&["--rdzv-backend", "c10d", "x.py"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("etcd-v3") && err.contains("static"), "{err}");
    }

    #[test]
    fn own_flags_parse() {
        let cli = parse(&[
            "--checkpoint-url",
            "file:///tmp/ck",
            "--lr-scaling",
            "sqrt",
            "--preemption-grace",
            "2m",
            "--preemption-notice",
            "http://127.0.0.1:1/x",
            "--rdzv-conf",
            "timeout=30, last_call=2",
            "--hang-timeout",
            "10s",
            "--nproc-per-node",
            "auto",
            "x.py",
        ])
        .unwrap();
        assert_eq!(cli.checkpoint_url, CheckpointUrl("file:///tmp/ck".into()));
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
        assert_eq!(cli.lr_scaling, LrScaling::Sqrt);
        assert_eq!(cli.preemption_grace, Duration::from_secs(120));
        assert_eq!(
            cli.preemption_notice,
            Some(PreemptionNotice {
                kind: NoticeKind::Generic,
                url: "http://127.0.0.1:1/x".into()
            })
        );
        let aws = parse_notice("aws=http://127.0.0.1:9/latest").unwrap();
        assert_eq!(
            (aws.kind, aws.url.as_str()),
            (NoticeKind::Aws, "http://127.0.0.1:9/latest")
        );
        assert_eq!(parse_notice("gcp").unwrap().url, GCP_NOTICE_URL);
        assert!(parse_notice("gcp=ftp://x").is_err());
        assert_eq!(cli.rebalance_action, RebalanceAction::Save);
        let drain = parse(&["--rebalance-action", "drain", "x.py"]).unwrap();
        assert_eq!(drain.rebalance_action, RebalanceAction::Drain);
        assert_eq!(cli.rdzv_conf.get("last_call"), Some("2"));
        assert_eq!(cli.hang_timeout, Some(Duration::from_secs(10)));
        assert_eq!(cli.nproc_per_node, NProc::Auto);
    }

    #[test]
    fn checkpoint_store_options_parse_repeated_and_as_a_list_and_hide_their_values() {
        let cli = parse(&[
            "--checkpoint-url",
            "s3://b/job",
            "--checkpoint-store-option",
            "AWS_ENDPOINT=http://127.0.0.1:9000",
            "--checkpoint-store-option",
            "region=eu-west-1,aws_secret_access_key=s3cr3t,timeout=30s",
            "x.py",
        ])
        .unwrap();
        let opts = cli.store_options();
        assert_eq!(
            opts,
            [
                ("aws_endpoint", "http://127.0.0.1:9000"),
                ("region", "eu-west-1"),
                ("aws_secret_access_key", "s3cr3t"),
                ("timeout", "30s"),
            ]
            .map(|(k, v)| (k.to_string(), v.to_string()))
        );
        let shown = format!("{cli:?}");
        assert!(shown.contains("aws_secret_access_key"), "{shown}");
        assert!(!shown.contains("s3cr3t"), "{shown}");
        assert_eq!(check_store_options("s3://b/job", &opts), Ok(()));
        // The environment's form: a comma before something that is not KEY= stays in the value.
        let l = parse_store_options("proxy_excludes=a.example,b.example, aws_region=x,").unwrap();
        assert_eq!(
            l.0,
            [
                ("proxy_excludes", "a.example,b.example"),
                ("aws_region", "x")
            ]
            .map(|(k, v)| (k.to_string(), v.to_string()))
        );
        assert_eq!(parse_store_options("").unwrap().0, []);
        assert!(parse(&["x.py"]).unwrap().store_options().is_empty());
    }

    #[test]
    fn bad_checkpoint_store_options_are_refused_by_name() {
        let err = parse(&["--checkpoint-store-option", "aws_regoin=x", "x.py"]).unwrap_err();
        assert_eq!(err.exit_code(), 2);
        assert!(err.to_string().contains("`aws_regoin`"), "{err}");
        let err = parse(&["--checkpoint-store-option", "hunter2", "x.py"]).unwrap_err();
        assert_eq!(err.exit_code(), 2);
        assert!(!err.to_string().contains("hunter2"), "{err}");
        // Known to some backend, but not to the URL's.
        let az = [("azure_storage_account_name".to_string(), "acct".to_string())];
        let e = check_store_options("s3://b/job", &az).unwrap_err();
        assert!(
            e.contains("`azure_storage_account_name`") && e.contains("s3://"),
            "{e}"
        );
        assert_eq!(check_store_options("az://c/job", &az), Ok(()));
        let gs = [("google_service_account".to_string(), "/k.json".to_string())];
        assert_eq!(check_store_options("gs://b/job", &gs), Ok(()));
        let e = check_store_options("file:///tmp/ck", &gs).unwrap_err();
        assert!(
            e.contains("take no options") && !e.contains("/k.json"),
            "{e}"
        );
        assert_eq!(check_store_options("file:///tmp/ck", &[]), Ok(()));
    }
}
