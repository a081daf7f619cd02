//! The environment every worker starts with: torchrun's contract plus `ELASTIC_*`.
//!
//! [`worker_env`] is a pure function of a node-constant [`WorkerSpec`], a per-generation
//! [`GenerationView`], the local rank and the restart count. The `elastic` crate's generation
//! record maps onto [`GenerationView`] field by field (world size, this node's rank offset,
//! master address and port, scaling decision, resume step); standalone and static runs build
//! one themselves. The scaling variables are [`ScalingDecision::env`]'s. What torchrun's
//! launcher flags and the agent's own environment add (`--signals-to-handle`,
//! `--virtual-local-rank`, `TORCH_NCCL_ASYNC_ERROR_HANDLING`) is a [`LauncherEnv`].

use std::path::{Path, PathBuf};

use elastic::ScalingDecision;

/// The variable naming the job (torchrun's), in every worker's environment.
pub const RUN_ID_ENV: &str = "TORCHELASTIC_RUN_ID";

/// Where workers resume from: a committed step laid out as `DIR/rank-*/` by the sink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResumePoint {
    pub step: u64,
    pub dir: PathBuf,
    /// Bytes the restore that laid it out read from the checkpoint store (0: none, such as a
    /// step reused from local bytes, or one the workers reached themselves).
    pub bytes_from_store: u64,
}

/// One generation of the job, as seen from this node.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationView {
    /// Generation number; 0 for the first (and only, in standalone) generation.
    pub generation: u64,
    /// Total workers in the job (WORLD_SIZE).
    pub world_size: u32,
    /// This node's rank among nodes (GROUP_RANK).
    pub node_rank: u32,
    /// Nodes in the generation (GROUP_WORLD_SIZE).
    pub node_count: u32,
    /// Global rank of this node's local rank 0.
    pub rank_offset: u32,
    pub master_addr: String,
    pub master_port: u16,
    /// The generation's scaling (the etcd leader's, or decided locally).
    pub scaling: ScalingDecision,
    pub resume: Option<ResumePoint>,
    /// The step this node joined at without restoring it (`ELASTIC_HEAL_STEP`): the
    /// generation's continuing members hold it in memory, and the workers take it from them,
    /// or ask the agent to restore it (`restore`).
    pub heal_step: Option<u64>,
}

/// What stays the same for this node across generations and restarts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSpec {
    /// Workers on this node (LOCAL_WORLD_SIZE).
    pub nproc: u32,
    pub role: String,
    pub run_id: String,
    pub node_id: String,
    pub max_restarts: u32,
    /// Steps between interval checkpoints; 0 = off.
    pub checkpoint_interval: u64,
    /// Node-local directory where workers write snapshots.
    pub staging_dir: PathBuf,
    /// The agent's Unix socket.
    pub agent_socket: PathBuf,
    /// Per-run directory for error files (`TORCHELASTIC_ERROR_FILE`).
    pub run_dir: PathBuf,
}

/// What the launcher flags and the agent's own environment add to every worker's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LauncherEnv {
    /// `--signals-to-handle`, as `TORCHELASTIC_SIGNALS_TO_HANDLE`.
    pub signals_to_handle: String,
    /// Whether the agent's environment sets `TORCH_NCCL_ASYNC_ERROR_HANDLING` (workers then
    /// inherit it; else it is 1, torchrun's).
    pub nccl_async_error_handling_set: bool,
    /// `--virtual-local-rank`: `LOCAL_RANK=0` and only the rank's own device visible.
    pub virtual_local_rank: bool,
    /// The agent's `CUDA_VISIBLE_DEVICES`: the list `--virtual-local-rank` picks from.
    pub cuda_visible_devices: Option<String>,
}

impl LauncherEnv {
    /// From the flags and the agent's environment.
    pub fn from_process(signals_to_handle: &str, virtual_local_rank: bool) -> LauncherEnv {
        LauncherEnv {
            signals_to_handle: signals_to_handle.to_string(),
            nccl_async_error_handling_set: std::env::var_os(NCCL_ASYNC_ERROR_HANDLING_ENV)
                .is_some(),
            virtual_local_rank,
            cuda_visible_devices: std::env::var("CUDA_VISIBLE_DEVICES").ok(),
        }
    }
}

impl Default for LauncherEnv {
    /// torchrun's defaults, nothing set by the agent's environment.
    fn default() -> Self {
        LauncherEnv {
            signals_to_handle: crate::cli::SIGNALS_TO_HANDLE_DEFAULT.to_string(),
            nccl_async_error_handling_set: false,
            virtual_local_rank: false,
            cuda_visible_devices: None,
        }
    }
}

/// NCCL's error handling switch, on in every worker unless the agent's environment says.
pub const NCCL_ASYNC_ERROR_HANDLING_ENV: &str = "TORCH_NCCL_ASYNC_ERROR_HANDLING";

/// Why a rank does not fit the generation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    #[error("local rank {local_rank} is outside this node's {nproc} workers")]
    LocalRankOutOfRange { local_rank: u32, nproc: u32 },
    #[error(
        "generation {generation}: ranks {first}..{end} of this node do not fit world size {world_size}"
    )]
    RanksOutsideWorld {
        generation: u64,
        first: u32,
        end: u64,
        world_size: u32,
    },
    #[error(
        "--virtual-local-rank: local rank {local_rank} has no device in CUDA_VISIBLE_DEVICES={visible}"
    )]
    NoDeviceForRank { local_rank: u32, visible: String },
}

/// The error file a worker of this attempt writes (torch's `@record` reads
/// `TORCHELASTIC_ERROR_FILE`). One per generation, restart and local rank, so a stale file from
/// an earlier attempt is never mistaken for the current error.
pub fn error_file(run_dir: &Path, generation: u64, restart_count: u32, local_rank: u32) -> PathBuf {
    run_dir
        .join(format!("g{generation}-attempt{restart_count}"))
        .join(local_rank.to_string())
        .join("error.json")
}

/// The variables to set for `local_rank` (on top of the agent's own environment), whose
/// `TORCHELASTIC_ERROR_FILE` is `error_file` (in the log dir, else [`error_file`]).
///
/// `omp_num_threads_set` says whether the agent's environment already has `OMP_NUM_THREADS`.
/// torchrun's rule: set it to 1 when unset and more than one worker shares the node, so
/// workers do not oversubscribe the cores.
pub fn worker_env(
    spec: &WorkerSpec,
    view: &GenerationView,
    local_rank: u32,
    restart_count: u32,
    omp_num_threads_set: bool,
    launcher: &LauncherEnv,
    error_file: &Path,
) -> Result<Vec<(String, String)>, EnvError> {
    if local_rank >= spec.nproc {
        return Err(EnvError::LocalRankOutOfRange {
            local_rank,
            nproc: spec.nproc,
        });
    }
    let end = u64::from(view.rank_offset) + u64::from(spec.nproc);
    if end > u64::from(view.world_size) {
        return Err(EnvError::RanksOutsideWorld {
            generation: view.generation,
            first: view.rank_offset,
            end,
            world_size: view.world_size,
        });
    }
    let rank = view.rank_offset + local_rank;
    // torchrun's virtual local rank: every worker is local rank 0 on the one device it sees.
    let (env_local_rank, device) = if launcher.virtual_local_rank {
        let device = match &launcher.cuda_visible_devices {
            Some(list) => list
                .split(',')
                .nth(local_rank as usize)
                .map(|d| d.trim().to_string())
                .ok_or_else(|| EnvError::NoDeviceForRank {
                    local_rank,
                    visible: list.clone(),
                })?,
            None => local_rank.to_string(),
        };
        (0, Some(device))
    } else {
        (local_rank, None)
    };
    let mut env: Vec<(String, String)> = vec![
        ("RANK".into(), rank.to_string()),
        ("LOCAL_RANK".into(), env_local_rank.to_string()),
        ("WORLD_SIZE".into(), view.world_size.to_string()),
        ("LOCAL_WORLD_SIZE".into(), spec.nproc.to_string()),
        ("GROUP_RANK".into(), view.node_rank.to_string()),
        ("GROUP_WORLD_SIZE".into(), view.node_count.to_string()),
        // One role per job: role ranks are the global ranks.
        ("ROLE_RANK".into(), rank.to_string()),
        ("ROLE_NAME".into(), spec.role.clone()),
        ("ROLE_WORLD_SIZE".into(), view.world_size.to_string()),
        ("MASTER_ADDR".into(), view.master_addr.clone()),
        ("MASTER_PORT".into(), view.master_port.to_string()),
        (
            "TORCHELASTIC_RESTART_COUNT".into(),
            restart_count.to_string(),
        ),
        (
            "TORCHELASTIC_MAX_RESTARTS".into(),
            spec.max_restarts.to_string(),
        ),
        (RUN_ID_ENV.into(), spec.run_id.clone()),
        // The workers build their own TCPStore from MASTER_ADDR/PORT (env://); the agent does
        // not host one.
        ("TORCHELASTIC_USE_AGENT_STORE".into(), "False".into()),
        ("TORCHELASTIC_ERROR_FILE".into(), path_str(error_file)),
        (
            "TORCHELASTIC_SIGNALS_TO_HANDLE".into(),
            launcher.signals_to_handle.clone(),
        ),
        ("ELASTIC_GENERATION".into(), view.generation.to_string()),
        ("ELASTIC_STAGING_DIR".into(), path_str(&spec.staging_dir)),
        (
            "ELASTIC_CHECKPOINT_INTERVAL".into(),
            spec.checkpoint_interval.to_string(),
        ),
        ("ELASTIC_AGENT_SOCKET".into(), path_str(&spec.agent_socket)),
        ("ELASTIC_NODE_ID".into(), spec.node_id.clone()),
        // Worker output may go to files or through the agent (--redirects, --tee); unbuffered
        // Python keeps lines timely and stdout and stderr in order.
        ("PYTHONUNBUFFERED".into(), "1".into()),
    ];
    if !launcher.nccl_async_error_handling_set {
        env.push((NCCL_ASYNC_ERROR_HANDLING_ENV.into(), "1".into()));
    }
    if let Some(d) = device {
        env.push(("CUDA_VISIBLE_DEVICES".into(), d));
    }
    if !omp_num_threads_set && spec.nproc > 1 {
        env.push(("OMP_NUM_THREADS".into(), "1".into()));
    }
    // LR scale, LR, batches, accumulation and warm-up: only the values the decision knows.
    env.extend(
        view.scaling
            .env()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v)),
    );
    if let Some(r) = &view.resume {
        env.push(("ELASTIC_RESUME_STEP".into(), r.step.to_string()));
        env.push(("ELASTIC_RESUME_DIR".into(), path_str(&r.dir)));
    } else if let Some(step) = view.heal_step {
        env.push(("ELASTIC_HEAL_STEP".into(), step.to_string()));
    }
    Ok(env)
}

/// The environment variables of a worker that change with the generation, for workers that
/// switch to `view` in place (the `generation` reply's `env`): the world and node counts, the
/// master, the generation, and every scaling variable ("" for one the generation leaves
/// unset). `RANK` and `ROLE_RANK` follow from the reply's rank offset; `ELASTIC_RESUME_*` and
/// `ELASTIC_HEAL_STEP` are "" (the workers continue from memory).
pub fn generation_env(view: &GenerationView) -> std::collections::BTreeMap<String, String> {
    let mut env: std::collections::BTreeMap<String, String> = [
        "ELASTIC_LR",
        "ELASTIC_GLOBAL_BATCH",
        "ELASTIC_BATCH_SIZE",
        "ELASTIC_RESUME_STEP",
        "ELASTIC_RESUME_DIR",
        "ELASTIC_HEAL_STEP",
    ]
    .into_iter()
    .map(|k| (k.to_string(), String::new()))
    .collect();
    for (k, v) in [
        ("WORLD_SIZE", view.world_size.to_string()),
        ("ROLE_WORLD_SIZE", view.world_size.to_string()),
        ("GROUP_RANK", view.node_rank.to_string()),
        ("GROUP_WORLD_SIZE", view.node_count.to_string()),
        ("MASTER_ADDR", view.master_addr.clone()),
        ("MASTER_PORT", view.master_port.to_string()),
        ("ELASTIC_GENERATION", view.generation.to_string()),
    ] {
        env.insert(k.to_string(), v);
    }
    for (k, v) in view.scaling.env() {
        env.insert(k.to_string(), v);
    }
    env
}

fn path_str(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> WorkerSpec {
        WorkerSpec {
            nproc: 2,
            role: "trainer".into(),
            run_id: "job42".into(),
            node_id: "node-b".into(),
            max_restarts: 3,
            checkpoint_interval: 50,
            staging_dir: "/dev/shm/er/job42/node-b".into(),
            agent_socket: "/tmp/er/agent.sock".into(),
            run_dir: "/tmp/er/run".into(),
        }
    }

    fn view() -> GenerationView {
        GenerationView {
            generation: 7,
            world_size: 6,
            node_rank: 1,
            node_count: 3,
            rank_offset: 2,
            master_addr: "10.0.0.1".into(),
            master_port: 29400,
            scaling: ScalingDecision {
                lr_scale: 1.5,
                lr: Some(0.15),
                per_worker_batch: Some(32),
                global_batch: Some(192),
                grad_accum_steps: 1,
                warmup_steps: 100,
                note: String::new(),
            },
            resume: Some(ResumePoint {
                step: 1200,
                dir: "/ck/step-1200".into(),
                bytes_from_store: 0,
            }),
            heal_step: None,
        }
    }

    fn env_of(
        spec: &WorkerSpec,
        view: &GenerationView,
        local_rank: u32,
        restart_count: u32,
        omp: bool,
    ) -> Result<Vec<(String, String)>, EnvError> {
        let file = error_file(&spec.run_dir, view.generation, restart_count, local_rank);
        worker_env(
            spec,
            view,
            local_rank,
            restart_count,
            omp,
            &LauncherEnv::default(),
            &file,
        )
    }

    fn get<'a>(env: &'a [(String, String)], k: &str) -> Option<&'a str> {
        let hits: Vec<_> = env.iter().filter(|(n, _)| n == k).collect();
        assert!(hits.len() <= 1, "{k} set twice");
        hits.first().map(|(_, v)| v.as_str())
    }

    #[test]
    fn second_local_rank_of_middle_node_gets_the_full_contract() {
        let env = env_of(&spec(), &view(), 1, 2, false).unwrap();
        let expect = [
            ("RANK", "3"),
            ("LOCAL_RANK", "1"),
            ("WORLD_SIZE", "6"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("GROUP_RANK", "1"),
            ("GROUP_WORLD_SIZE", "3"),
            ("ROLE_RANK", "3"),
            ("ROLE_NAME", "trainer"),
            ("ROLE_WORLD_SIZE", "6"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29400"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
            ("TORCHELASTIC_MAX_RESTARTS", "3"),
            ("TORCHELASTIC_RUN_ID", "job42"),
            ("TORCHELASTIC_USE_AGENT_STORE", "False"),
            (
                "TORCHELASTIC_ERROR_FILE",
                "/tmp/er/run/g7-attempt2/1/error.json",
            ),
            ("OMP_NUM_THREADS", "1"),
            ("ELASTIC_GENERATION", "7"),
            ("ELASTIC_LR_SCALE", "1.5"),
            ("ELASTIC_LR", "0.15"),
            ("ELASTIC_GLOBAL_BATCH", "192"),
            ("ELASTIC_GRAD_ACCUM_STEPS", "1"),
            ("ELASTIC_BATCH_SIZE", "32"),
            ("ELASTIC_WARMUP_STEPS", "100"),
            ("ELASTIC_STAGING_DIR", "/dev/shm/er/job42/node-b"),
            ("ELASTIC_RESUME_STEP", "1200"),
            ("ELASTIC_RESUME_DIR", "/ck/step-1200"),
            ("ELASTIC_CHECKPOINT_INTERVAL", "50"),
            ("ELASTIC_AGENT_SOCKET", "/tmp/er/agent.sock"),
            ("ELASTIC_NODE_ID", "node-b"),
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            (
                "TORCHELASTIC_SIGNALS_TO_HANDLE",
                "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
            ),
        ];
        for (k, v) in expect {
            assert_eq!(get(&env, k), Some(v), "{k}");
        }
    }

    #[test]
    fn omp_threads_left_alone_when_user_set_it_or_single_worker() {
        let env = env_of(&spec(), &view(), 0, 0, true).unwrap();
        assert_eq!(get(&env, "OMP_NUM_THREADS"), None);
        let mut one = spec();
        one.nproc = 1;
        let mut v = view();
        v.rank_offset = 0;
        let env = env_of(&one, &v, 0, 0, false).unwrap();
        assert_eq!(get(&env, "OMP_NUM_THREADS"), None);
    }

    #[test]
    fn unknown_values_are_absent_rather_than_empty() {
        let mut v = view();
        v.scaling = ScalingDecision::identity();
        v.resume = None;
        let env = env_of(&spec(), &v, 0, 0, false).unwrap();
        for k in [
            "ELASTIC_LR",
            "ELASTIC_BATCH_SIZE",
            "ELASTIC_GLOBAL_BATCH",
            "ELASTIC_RESUME_STEP",
            "ELASTIC_RESUME_DIR",
            "ELASTIC_HEAL_STEP",
        ] {
            assert_eq!(get(&env, k), None, "{k}");
        }
        assert_eq!(get(&env, "ELASTIC_LR_SCALE"), Some("1"));
        assert_eq!(get(&env, "ELASTIC_GRAD_ACCUM_STEPS"), Some("1"));
        assert_eq!(get(&env, "ELASTIC_WARMUP_STEPS"), Some("0"));
        assert!(env.iter().all(|(_, v)| !v.is_empty()));
    }

    #[test]
    fn a_node_that_heals_from_peers_gets_the_step_and_no_restore_dir() {
        let mut v = view();
        v.resume = None;
        v.heal_step = Some(1200);
        let env = env_of(&spec(), &v, 0, 0, false).unwrap();
        assert_eq!(get(&env, "ELASTIC_HEAL_STEP"), Some("1200"));
        assert_eq!(get(&env, "ELASTIC_RESUME_STEP"), None);
        assert_eq!(get(&env, "ELASTIC_RESUME_DIR"), None);
        // Workers that switch in place drop it.
        assert_eq!(
            generation_env(&v)
                .get("ELASTIC_HEAL_STEP")
                .map(String::as_str),
            Some("")
        );
    }

    #[test]
    fn scaling_variables_are_the_decisions_env() {
        let names = [
            "ELASTIC_LR_SCALE",
            "ELASTIC_LR",
            "ELASTIC_GLOBAL_BATCH",
            "ELASTIC_GRAD_ACCUM_STEPS",
            "ELASTIC_BATCH_SIZE",
            "ELASTIC_WARMUP_STEPS",
        ];
        for scaling in [view().scaling, ScalingDecision::identity()] {
            let mut v = view();
            v.scaling = scaling.clone();
            let env = env_of(&spec(), &v, 0, 0, false).unwrap();
            let want = scaling.env();
            for (k, value) in &want {
                assert_eq!(get(&env, k), Some(value.as_str()), "{k}");
            }
            for k in names {
                assert_eq!(
                    get(&env, k).is_some(),
                    want.iter().any(|(n, _)| *n == k),
                    "{k}"
                );
            }
        }
    }

    #[test]
    fn ranks_outside_the_world_are_refused() {
        let mut v = view();
        v.rank_offset = 5; // ranks 5 and 6 in a world of 6
        assert!(matches!(
            env_of(&spec(), &v, 0, 0, false),
            Err(EnvError::RanksOutsideWorld { .. })
        ));
        assert!(matches!(
            env_of(&spec(), &view(), 2, 0, false),
            Err(EnvError::LocalRankOutOfRange { .. })
        ));
    }

    #[test]
    fn launcher_flags_and_the_agents_environment_reach_the_workers() {
        let file = Path::new("/logs/attempt_3/1/error.json");
        let mut l = LauncherEnv {
            signals_to_handle: "SIGTERM,SIGUSR1".into(),
            nccl_async_error_handling_set: true,
            virtual_local_rank: true,
            cuda_visible_devices: Some("4, 6".into()),
        };
        let env = worker_env(&spec(), &view(), 1, 0, false, &l, file).unwrap();
        assert_eq!(
            get(&env, "TORCHELASTIC_ERROR_FILE"),
            Some("/logs/attempt_3/1/error.json")
        );
        assert_eq!(
            get(&env, "TORCHELASTIC_SIGNALS_TO_HANDLE"),
            Some("SIGTERM,SIGUSR1")
        );
        // Set by the agent's environment: inherited as it is.
        assert_eq!(get(&env, "TORCH_NCCL_ASYNC_ERROR_HANDLING"), None);
        assert_eq!(get(&env, "LOCAL_RANK"), Some("0"));
        assert_eq!(get(&env, "RANK"), Some("3"));
        assert_eq!(get(&env, "CUDA_VISIBLE_DEVICES"), Some("6"));
        l.cuda_visible_devices = None;
        let env = worker_env(&spec(), &view(), 1, 0, false, &l, file).unwrap();
        assert_eq!(get(&env, "CUDA_VISIBLE_DEVICES"), Some("1"));
        l.cuda_visible_devices = Some("4".into());
        assert!(matches!(
            worker_env(&spec(), &view(), 1, 0, false, &l, file),
            Err(EnvError::NoDeviceForRank { local_rank: 1, .. })
        ));
        let plain = env_of(&spec(), &view(), 1, 0, false).unwrap();
        assert_eq!(get(&plain, "LOCAL_RANK"), Some("1"));
        assert_eq!(get(&plain, "CUDA_VISIBLE_DEVICES"), None);
    }

    #[test]
    fn error_files_differ_per_attempt_and_rank() {
        let r = Path::new("/r");
        assert_ne!(error_file(r, 0, 0, 0), error_file(r, 0, 1, 0));
        assert_ne!(error_file(r, 0, 0, 0), error_file(r, 1, 0, 0));
        assert_ne!(error_file(r, 0, 0, 0), error_file(r, 0, 0, 1));
    }
}
