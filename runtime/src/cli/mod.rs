//! The command line: torchrun's flags with torchrun's spelling, plus elastic-run's own.
//!
//! Every torchrun flag also reads `PET_<FLAG>` (Kubeflow's PyTorchJob sets them), and accepts
//! torchrun's underscore spelling (`--nproc_per_node`). Values clap cannot check itself are
//! parsed by `value_parser` functions, so a bad value is a usage error (exit 2) with a
//! message naming the flag, exactly like an unknown flag.
//!
//! - `mod.rs`: the [`Cli`] struct, its flags (with their `PET_*` and `ELASTIC_*` variables)
//!   and their defaults.
//! - `values.rs`: the value types and their parsers ([`NNodes`], [`NProc`], [`RdzvBackend`],
//!   [`RdzvConf`], durations, [`CheckpointUrl`], [`PreemptionNotice`]).
//! - `store.rs`: `--checkpoint-store-option` ([`StoreOptionList`], [`check_store_options`]).
//! - `scaling.rs`: the scaling flags, parsed into the `elastic` crate's own types, and the
//!   job's [`elastic::ScalingConfig`] ([`Cli::scaling_config`]).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use elastic::scaling::{OnIndivisible, ScalingMode};

mod console;
mod scaling;
mod store;
mod values;

pub use console::{LocalRanks, Std, StdSpec};
use console::{parse_local_ranks, parse_std_spec};

pub use store::{StoreOptionList, StoreOptionsParser, check_store_options, store_option_known};
pub(crate) use values::parse_rdzv_conf;
pub use values::{
    AWS_NOTICE_URL, AZURE_NOTICE_URL, CHECKPOINT_SCHEMES, CheckpointUrl, EventLogHandler,
    GCP_NOTICE_URL, NNodes, NProc, NoticeKind, PreemptionNotice, RdzvBackend, RdzvConf,
    RebalanceAction, StartMethod, parse_duration,
};
use values::{
    parse_backend, parse_bool_env, parse_checkpoint_url, parse_filters, parse_keep_last,
    parse_logs_specs, parse_nnodes, parse_notice, parse_nproc, parse_positive_duration,
    parse_positive_f64, parse_signals,
};

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
pub const CHECKPOINT_KEEP_LAST_DEFAULT: usize = crate::pipeline::KEEP_STEPS_DEFAULT;
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

/// `elastic-run`: a drop-in for `torchrun` that keeps data-parallel training going on
/// preemptible machines.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "elastic-run",
    version,
    // argparse (torchrun) takes any unambiguous prefix of a long flag (`--redirect=3`).
    infer_long_args = true,
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

    /// Rendezvous backend. `etcd-v3` (alias `etcd`): membership in the etcd v3 cluster at
    /// `--rdzv-endpoint`, the one to use for jobs that must outlive any node. `c10d`, as in
    /// torchrun, needs no service of its own: the agent on the endpoint's host starts an etcd
    /// at the endpoint (unless one already answers there) and every agent speaks etcd v3 to it;
    /// that node is then the one the job cannot lose. `static`: a fixed set of nodes
    /// (`--nnodes N --node-rank --master-addr --master-port`). Default: `etcd-v3` when
    /// `--rdzv-endpoint` is given with an elastic `--nnodes MIN:MAX`, else `static`.
    #[arg(long = "rdzv-backend", alias = "rdzv_backend", env = "PET_RDZV_BACKEND",
          value_parser = parse_backend)]
    pub rdzv_backend: Option<RdzvBackend>,

    /// Rendezvous endpoint: `HOST:PORT[,HOST:PORT...]` of etcd (`etcd-v3`, `c10d`; c10d's
    /// port defaults to 29400), or the master's `HOST:PORT` under `static`.
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
    #[arg(long, env = "PET_STANDALONE", num_args = 0, default_missing_value = "1",
          default_value = "0", action = clap::ArgAction::Set, value_parser = parse_bool_env)]
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

    /// Run CMD as a Python module (`python -m CMD`); not with `--no-python`.
    #[arg(short = 'm', long = "module", env = "PET_MODULE", num_args = 0,
          default_missing_value = "1", default_value = "0", action = clap::ArgAction::Set, value_parser = parse_bool_env)]
    pub module: bool,

    /// Execute CMD directly, without prepending the Python interpreter.
    #[arg(long = "no-python", alias = "no_python", env = "PET_NO_PYTHON", num_args = 0,
          default_missing_value = "1", default_value = "0", action = clap::ArgAction::Set, value_parser = parse_bool_env)]
    pub no_python: bool,

    /// Run CMD as a Python script path (the default for a `*.py` CMD); takes precedence over
    /// `--no-python` and `--module`, as in torchrun.
    #[arg(long = "run-path", alias = "run_path", env = "PET_RUN_PATH", num_args = 0,
          default_missing_value = "1", default_value = "0", action = clap::ArgAction::Set, value_parser = parse_bool_env)]
    pub run_path: bool,

    /// How torchrun would start workers: `spawn`, `fork` or `forkserver`. elastic-run always
    /// execs every worker as a new process (what `spawn` does for a script), so the three run
    /// alike; the flag is accepted so that torchrun command lines run unchanged.
    #[arg(long = "start-method", alias = "start_method", env = "PET_START_METHOD", value_enum,
          default_value_t = StartMethod::Spawn)]
    pub start_method: StartMethod,

    /// torchrun's logs-specs plug-in. elastic-run has one, `default`: the `--log-dir` layout
    /// of torchrun's default; any other name is refused.
    #[arg(long = "logs-specs", alias = "logs_specs", value_parser = parse_logs_specs)]
    pub logs_specs: Option<String>,

    /// torchrun's event sink, `null` or `console`. elastic-run logs its events (generations,
    /// restarts, failures) to its own log either way, and to `--events-file` as JSON lines.
    #[arg(long = "event-log-handler", alias = "event_log_handler", env = "PET_EVENT_LOG_HANDLER",
          value_enum, default_value_t = EventLogHandler::Null)]
    pub event_log_handler: EventLogHandler,

    /// Base directory for the workers' log files, torchrun's layout:
    /// `DIR/RUN_ID_XXXX/attempt_N/LOCAL_RANK/{stdout,stderr}.log` and `error.json`, one
    /// `RUN_ID_XXXX` per agent. `N` counts the worker groups this agent started (0, 1, ...;
    /// torchrun's restart count, except that a membership change also starts a new group), so
    /// no group's logs overwrite another's. Default: a new temporary directory
    /// (`torchelastic_XXXX`) when `--redirects` or `--tee` needs one.
    #[arg(long = "log-dir", alias = "log_dir", env = "PET_LOG_DIR")]
    pub log_dir: Option<PathBuf>,

    /// Streams of each worker to write to its log file instead of the console: `0` none (the
    /// default: workers write straight to this terminal), `1` stdout, `2` stderr, `3` both, or
    /// per local rank (`0:1,1:2`).
    #[arg(short = 'r', long = "redirects", env = "PET_REDIRECTS", default_value = "0",
          value_parser = parse_std_spec)]
    pub redirects: StdSpec,

    /// Streams of each worker to write to its log file and also to the console, each line
    /// prefixed with `[ROLE LOCAL_RANK]:` (`[default0]:`) or
    /// `TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE` (`${role_name}`, `${rank}`, `${local_rank}`);
    /// values as for `--redirects`.
    #[arg(short = 't', long = "tee", env = "PET_TEE", default_value = "0",
          value_parser = parse_std_spec)]
    pub tee: StdSpec,

    /// Only these local ranks' output reaches the console (`0` or `0,2`); the others' is still
    /// written to their log files when redirected or teed.
    #[arg(long = "local-ranks-filter", alias = "local_ranks_filter", env = "PET_LOCAL_RANKS_FILTER",
          default_value = "", value_parser = parse_local_ranks)]
    pub local_ranks_filter: LocalRanks,

    /// Also copy the teed stdout lines that contain any of these strings to
    /// `attempt_N/filtered_stdout.log` (comma-separated; `,,` is a literal comma).
    #[arg(long = "duplicate-stdout-filters", alias = "duplicate_stdout_filters",
          env = "PET_DUPLICATE_STDOUT_FILTERS", default_value = "", value_parser = parse_filters)]
    pub duplicate_stdout_filters: Filters,

    /// As `--duplicate-stdout-filters`, for stderr (`filtered_stderr.log`).
    #[arg(long = "duplicate-stderr-filters", alias = "duplicate_stderr_filters",
          env = "PET_DUPLICATE_STDERR_FILTERS", default_value = "", value_parser = parse_filters)]
    pub duplicate_stderr_filters: Filters,

    /// Signals the agent handles (drains on) and passes on to the workers, as
    /// `TORCHELASTIC_SIGNALS_TO_HANDLE`: a comma-separated list of `SIGTERM`, `SIGINT`,
    /// `SIGHUP`, `SIGQUIT`, `SIGUSR1`, `SIGUSR2`.
    #[arg(long = "signals-to-handle", alias = "signals_to_handle", env = "PET_SIGNALS_TO_HANDLE",
          default_value = SIGNALS_TO_HANDLE_DEFAULT, value_parser = parse_signals)]
    pub signals_to_handle: Signals,

    /// Seconds between SIGTERM and SIGKILL when the agent stops its workers (default
    /// `TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, else 5: torchrun waits 30, but a quick recovery
    /// matters more here). A drain waits `--preemption-grace` instead.
    #[arg(long = "shutdown-timeout", alias = "shutdown_timeout", env = "PET_SHUTDOWN_TIMEOUT",
          value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub shutdown_timeout: Option<u64>,

    /// Every worker sees `LOCAL_RANK=0` and only its own GPU (`CUDA_VISIBLE_DEVICES`), so every
    /// rank compiles for device 0.
    #[arg(long = "virtual-local-rank", alias = "virtual_local_rank", env = "PET_VIRTUAL_LOCAL_RANK",
          num_args = 0, default_missing_value = "1", default_value = "0", action = clap::ArgAction::Set, value_parser = parse_bool_env)]
    pub virtual_local_rank: bool,

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
    #[arg(long = "lr-scaling", env = "ELASTIC_LR_SCALING", default_value_t = ScalingMode::None,
          value_parser = scaling::lr_scaling_parser())]
    pub lr_scaling: ScalingMode,

    /// World size the base LR and batch were tuned for (default: nproc x the most nodes of
    /// `--nnodes`).
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

    /// Keep a warm standby interpreter per local rank (torch imported) while the workers
    /// train, and start the next group's workers in them: a restart skips the interpreter's
    /// start and `import torch`. For `PYTHON -u SCRIPT` and `-m MODULE` command lines; costs a
    /// whole idle interpreter's memory per local rank.
    #[arg(long = "warm-standby", env = "ELASTIC_WARM_STANDBY", num_args = 0,
          default_missing_value = "1", default_value = "0", action = clap::ArgAction::Set,
          value_parser = parse_bool_env)]
    pub warm_standby: bool,

    /// Resume from a `file://` store without copying: the agent checks the resume step's raw
    /// chunks where they lie and writes no `state.safetensors` into staging, only where its
    /// bytes lie (`rank-R/sources.json`), and `elastic_run.load` (or the Rust client) reads
    /// each tensor from the chunks. A script that opens `state.safetensors` itself needs it
    /// off; compressed chunks and remote stores are restored into staging as without it.
    #[arg(long = "restore-no-copy", env = "ELASTIC_RESTORE_NO_COPY", num_args = 0,
          default_missing_value = "1", default_value = "0", action = clap::ArgAction::Set,
          value_parser = parse_bool_env)]
    pub restore_no_copy: bool,

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
    #[arg(long = "indivisible-batch", env = "ELASTIC_INDIVISIBLE_BATCH",
          default_value_t = OnIndivisible::Nearest, value_parser = scaling::indivisible_batch_parser())]
    pub indivisible_batch: OnIndivisible,

    /// The training command and its arguments (after `--`, or a `*.py` script torchrun-style).
    #[arg(required = true, trailing_var_arg = true, value_name = "CMD")]
    pub cmd: Vec<String>,
}

/// Default `--signals-to-handle`, torchrun's.
pub const SIGNALS_TO_HANDLE_DEFAULT: &str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT";

pub use values::{Filters, Signals};

/// Parses `args` after the program name, as `main` does (tests).
#[cfg(test)]
pub(crate) fn try_parse(args: &[&str]) -> Result<Cli, clap::Error> {
    Cli::try_parse_from(std::iter::once("elastic-run").chain(args.iter().copied()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        try_parse(args)
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
        assert_eq!(cli.rdzv_backend, Some(RdzvBackend::EtcdV3));
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
            &["--rdzv-backend", "zookeeper", "x.py"],
            &["--nnodes", "2:20:30", "x.py"],
            &["--start-method", "thread", "x.py"],
            &["--logs-specs", "DOESNOT_EXIST", "x.py"],
            &["--redirects", "4", "x.py"],
            &["--tee", "0:9", "x.py"],
            &["--local-ranks-filter", "a", "x.py"],
            &["--signals-to-handle", "SIGKILL", "x.py"],
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
    fn torchrun_launcher_flags_parse_with_torchrun_spellings() {
        let cli = parse(&[
            "--start-method=spawn",
            "--logs_specs=default",
            "--redirect=3",
            "-t",
            "0:1,1:2",
            "--log_dir",
            "/tmp/logs",
            "--local-ranks-filter=0",
            "--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'",
            "--shutdown-timeout=7",
            "--signals_to_handle=SIGTERM,SIGUSR1",
            "--virtual-local-rank",
            "--no-python",
            "--module",
            "x",
        ])
        .unwrap();
        assert_eq!(cli.start_method, StartMethod::Spawn);
        assert_eq!(cli.logs_specs.as_deref(), Some("default"));
        assert_eq!(cli.redirects, StdSpec::All(Std::ALL));
        assert_eq!(cli.tee.of(1), Std::ERR);
        assert_eq!(cli.log_dir, Some(PathBuf::from("/tmp/logs")));
        assert!(cli.local_ranks_filter.shows(0) && !cli.local_ranks_filter.shows(1));
        assert_eq!(cli.rdzv_conf.get("join_timeout"), Some("5"));
        assert_eq!(cli.shutdown_timeout, Some(7));
        assert_eq!(cli.signals_to_handle.names, "SIGTERM,SIGUSR1");
        assert!(cli.virtual_local_rank && cli.no_python && cli.module && !cli.run_path);
        let plain = parse(&["x.py"]).unwrap();
        assert!(!plain.module && !plain.no_python && !plain.standalone);
        assert_eq!(plain.rdzv_backend, None);
        assert_eq!(plain.redirects, StdSpec::None);
        assert_eq!(plain.signals_to_handle.names, SIGNALS_TO_HANDLE_DEFAULT);
        // A flag's name still reaches its message.
        let e = parse(&["--nproc-per-node", "unknown", "x.py"]).unwrap_err();
        assert!(e.to_string().contains("--nproc-per-node") && e.to_string().contains("unknown"));
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
        assert_eq!(cli.lr_scaling, ScalingMode::Sqrt);
        assert_eq!(cli.preemption_grace, Duration::from_secs(120));
        assert_eq!(
            cli.preemption_notice,
            Some(PreemptionNotice {
                kind: NoticeKind::Generic,
                url: "http://127.0.0.1:1/x".into()
            })
        );
        assert_eq!(cli.rebalance_action, RebalanceAction::Save);
        let drain = parse(&["--rebalance-action", "drain", "x.py"]).unwrap();
        assert_eq!(drain.rebalance_action, RebalanceAction::Drain);
        assert_eq!(cli.rdzv_conf.get("last_call"), Some("2"));
        assert_eq!(cli.hang_timeout, Some(Duration::from_secs(10)));
        assert_eq!(cli.nproc_per_node, NProc::Auto);
    }
}
