//! The Rust worker client: what a Rust training process under `elastic-run` uses, the same
//! contract as the Python client (`runtime/python/elastic_run`).
//!
//! - [`Worker::from_env`] reads torchrun's variables and `ELASTIC_*`, and connects to the
//!   agent's socket when there is one (it works without an agent too: no drain, no commits).
//! - [`Worker::scaled_lr`], [`Worker::grad_accum_steps`]: the scaling decision.
//! - [`Worker::report_progress`], [`Worker::should_stop`], [`Worker::should_checkpoint`]: the
//!   per-step protocol.
//! - [`Worker::save_tensors`] writes this rank's share of a snapshot into staging
//!   (`step-N/rank-R/tensors.safetensors` + `meta.json`, the Python client's format: replicated
//!   tensors split between ranks by bytes, so every byte is written once) and tells the agent;
//!   [`Worker::load_tensors`] reads the step the agent restored. The `elastic-run-worker-tch`
//!   crate saves and loads tch `VarStore`s (the model, and the optimizer state kept as a
//!   second `VarStore`) through it.
//!
//! A Rust worker has no process group of its own (tch has no collectives), so `should_stop` asks
//! the agent for each rank without an all-reduce: run one worker per node, or make the ranks
//! agree on the stop step yourself.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use serde_json::Value;

use crate::protocol::{
    self, FORMAT_VERSION, MESSAGE_BYTES_MAX, METADATA_BYTES_MAX, RESTORED_META, RESTORED_SOURCES,
    RESTORED_TENSORS, Request, STAGED_META, STAGED_TENSORS, StagedMeta,
};

/// Progress reports are rate-limited: the watchdog works in seconds, not steps.
const PROGRESS_INTERVAL_MS: u64 = 100;
/// How long one request to the agent may take.
const SOCKET_TIMEOUT_MS: u64 = 30_000;
/// A `saved` reply waits while earlier checkpoints are still being committed (the agent bounds
/// how far training runs ahead of the store); a slow store can hold it this long.
const SAVED_TIMEOUT_MS: u64 = 1_800_000;

/// What went wrong, naming the file or variable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    #[error("environment variable {name}={value:?}: {reason}")]
    Env {
        name: &'static str,
        value: String,
        reason: String,
    },
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Format { path: PathBuf, reason: String },
    #[error("agent socket: {0}")]
    Agent(String),
    #[error("ELASTIC_STAGING_DIR is not set: run under elastic-run")]
    NoStaging,
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> WorkerError + 'a {
    move |source| WorkerError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// One tensor of a snapshot, as raw little-endian bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

/// A loaded snapshot.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub step: u64,
    pub tensors: Vec<SnapshotTensor>,
    /// The JSON state saved with it.
    pub state: Value,
}

/// This worker's view of the job, and its connection to the agent.
pub struct Worker {
    pub rank: u32,
    pub local_rank: u32,
    pub world_size: u32,
    pub generation: u64,
    pub lr_scale: f64,
    pub grad_accum_steps: u64,
    pub checkpoint_interval: u64,
    pub resume_step: Option<u64>,
    resume_dir: Option<PathBuf>,
    staging: Option<PathBuf>,
    conn: Option<Conn>,
    last_progress: Option<Instant>,
    checkpoint_at: Option<u64>,
    /// The step this worker stops at (its `should_stop` said yes, or `peer_stop`): a save of
    /// it or later is its last.
    stop_step: Option<u64>,
}

struct Conn {
    write: UnixStream,
    read: BufReader<UnixStream>,
}

impl Conn {
    fn set_read_timeout_ms(&self, ms: u64) -> Result<(), WorkerError> {
        self.read
            .get_ref()
            .set_read_timeout(Some(Duration::from_millis(ms)))
            .map_err(|e| WorkerError::Agent(format!("configure the socket: {e}")))
    }

    fn request(&mut self, req: &Request) -> Result<Value, WorkerError> {
        let mut line = serde_json::to_string(req)
            .map_err(|e| WorkerError::Agent(format!("encode a {} request: {e}", req.kind())))?;
        line.push('\n');
        self.write
            .write_all(line.as_bytes())
            .map_err(|e| WorkerError::Agent(format!("send: {e}")))?;
        let mut buf = Vec::with_capacity(256);
        let n = (&mut self.read)
            .take(MESSAGE_BYTES_MAX as u64)
            .read_until(b'\n', &mut buf)
            .map_err(|e| WorkerError::Agent(format!("receive: {e}")))?;
        if n == 0 || buf.last() != Some(&b'\n') {
            return Err(WorkerError::Agent(
                "connection closed or reply too long".into(),
            ));
        }
        let v: Value = serde_json::from_slice(&buf)
            .map_err(|e| WorkerError::Agent(format!("bad reply: {e}")))?;
        if v["type"] == "error" {
            return Err(WorkerError::Agent(
                v["message"].as_str().unwrap_or("error").to_string(),
            ));
        }
        Ok(v)
    }
}

fn env_u64(name: &'static str, default: Option<u64>) -> Result<Option<u64>, WorkerError> {
    match std::env::var(name) {
        Ok(v) if !v.is_empty() => v.trim().parse().map(Some).map_err(|_| WorkerError::Env {
            name,
            value: v,
            reason: "not a non-negative integer".into(),
        }),
        _ => Ok(default),
    }
}

fn env_f64(name: &'static str, default: f64) -> Result<f64, WorkerError> {
    match std::env::var(name) {
        Ok(v) if !v.is_empty() => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|x| x.is_finite())
            .ok_or(WorkerError::Env {
                name,
                value: v,
                reason: "not a number".into(),
            }),
        _ => Ok(default),
    }
}

impl Worker {
    /// Reads the environment `elastic-run` sets; connects to the agent when it runs one.
    pub fn from_env() -> Result<Worker, WorkerError> {
        let u32_of = |name: &'static str, default: u64| -> Result<u32, WorkerError> {
            let v = env_u64(name, Some(default))?.unwrap_or(default);
            u32::try_from(v).map_err(|_| WorkerError::Env {
                name,
                value: v.to_string(),
                reason: "too large".into(),
            })
        };
        let rank = u32_of("RANK", 0)?;
        let world_size = u32_of("WORLD_SIZE", 1)?.max(1);
        if rank >= world_size {
            return Err(WorkerError::Env {
                name: "RANK",
                value: rank.to_string(),
                reason: format!("not below WORLD_SIZE {world_size}"),
            });
        }
        let path = |name: &str| {
            std::env::var_os(name)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        let conn = match path("ELASTIC_AGENT_SOCKET") {
            Some(p) => {
                let s = UnixStream::connect(&p).map_err(io("connect", &p))?;
                let t = Some(Duration::from_millis(SOCKET_TIMEOUT_MS));
                s.set_read_timeout(t).map_err(io("configure", &p))?;
                s.set_write_timeout(t).map_err(io("configure", &p))?;
                let read = BufReader::new(s.try_clone().map_err(io("clone", &p))?);
                Some(Conn { write: s, read })
            }
            None => None,
        };
        let mut w = Worker {
            rank,
            local_rank: u32_of("LOCAL_RANK", 0)?,
            world_size,
            generation: env_u64("ELASTIC_GENERATION", Some(0))?.unwrap_or(0),
            lr_scale: env_f64("ELASTIC_LR_SCALE", 1.0)?,
            grad_accum_steps: env_u64("ELASTIC_GRAD_ACCUM_STEPS", Some(1))?
                .unwrap_or(1)
                .max(1),
            checkpoint_interval: env_u64("ELASTIC_CHECKPOINT_INTERVAL", Some(0))?.unwrap_or(0),
            resume_step: env_u64("ELASTIC_RESUME_STEP", None)?,
            resume_dir: path("ELASTIC_RESUME_DIR"),
            staging: path("ELASTIC_STAGING_DIR"),
            conn,
            last_progress: None,
            checkpoint_at: None,
            stop_step: None,
        };
        // The node joined a generation without restoring its step, for peers that hold it in
        // memory; this client cannot take state from peers, so it asks the agent for the step.
        if let (Some(step), None) = (env_u64("ELASTIC_HEAL_STEP", None)?, &w.resume_dir) {
            w.restore_on_demand(step)?;
        }
        Ok(w)
    }

    /// Asks the agent to restore `step` (or the newest older step that verifies) and takes
    /// the reply as `ELASTIC_RESUME_STEP` and `ELASTIC_RESUME_DIR`.
    fn restore_on_demand(&mut self, step: u64) -> Result<(), WorkerError> {
        let rank = self.rank;
        let Some(c) = self.conn.as_mut() else {
            return Err(WorkerError::Env {
                name: "ELASTIC_HEAL_STEP",
                value: step.to_string(),
                reason: "set, but there is no agent to restore the step (ELASTIC_AGENT_SOCKET)"
                    .into(),
            });
        };
        c.set_read_timeout_ms(protocol::RESTORE_WAIT_MS)?;
        let reply = c.request(&Request::Restore { rank, step });
        c.set_read_timeout_ms(SOCKET_TIMEOUT_MS)?;
        let reply = reply?;
        let (Some(got), Some(dir)) = (reply["step"].as_u64(), reply["dir"].as_str()) else {
            return Err(WorkerError::Agent(format!(
                "a restore reply without a step and a dir: {reply}"
            )));
        };
        if reply["type"] != "restored" || got > step || dir.is_empty() {
            return Err(WorkerError::Agent(format!(
                "a bad reply to the restore of step {step}: {reply}"
            )));
        }
        self.resume_step = Some(got);
        self.resume_dir = Some(PathBuf::from(dir));
        Ok(())
    }

    /// `base` scaled for the current world size.
    pub fn scaled_lr(&self, base: f64) -> f64 {
        base * self.lr_scale
    }

    /// Tells the agent this rank finished `step` (rate-limited; feeds the hang watchdog).
    pub fn report_progress(&mut self, step: u64) -> Result<(), WorkerError> {
        let due = self
            .last_progress
            .is_none_or(|t| t.elapsed() >= Duration::from_millis(PROGRESS_INTERVAL_MS));
        if let (true, Some(c)) = (due, self.conn.as_mut()) {
            c.request(&Request::Progress {
                rank: self.rank,
                step,
            })?;
            self.last_progress = Some(Instant::now());
        }
        Ok(())
    }

    /// Whether to save `step` and exit (the agent drains). Also learns a step the agent wants
    /// a checkpoint at, for [`Worker::should_checkpoint`].
    pub fn should_stop(&mut self, step: u64) -> Result<bool, WorkerError> {
        let Some(c) = self.conn.as_mut() else {
            return Ok(false);
        };
        let v = c.request(&Request::Query {})?;
        if let Some(at) = v["should_checkpoint_at"].as_u64() {
            self.checkpoint_at = Some(at);
        }
        let stop = v["should_stop"].as_bool().unwrap_or(false);
        if stop {
            self.stop_step.get_or_insert(step);
        }
        Ok(stop)
    }

    /// Tells the agent that the workers agreed to stop at `step` because another node's agent
    /// asked (this one's [`Worker::should_stop`] said no): callers that combine
    /// `should_stop` across ranks themselves call this on the ranks whose own answer was no,
    /// so the agent does not take the clean exit for the end of the job.
    pub fn peer_stop(&mut self, step: u64) -> Result<(), WorkerError> {
        self.stop_step.get_or_insert(step);
        if let Some(c) = self.conn.as_mut() {
            c.request(&Request::PeerStop {
                rank: self.rank,
                step,
            })?;
        }
        Ok(())
    }

    /// Whether `step` is a checkpoint step: every `--checkpoint-interval` steps, or the step
    /// the agent asked for.
    pub fn should_checkpoint(&mut self, step: u64) -> bool {
        let n = self.checkpoint_interval;
        if n > 0 && step > 0 && step.is_multiple_of(n) {
            return true;
        }
        if self.checkpoint_at.is_some_and(|at| step >= at) {
            self.checkpoint_at = None;
            return true;
        }
        false
    }

    /// Writes this rank's share of `tensors` (the same replicated state on every rank) for
    /// `step` into staging, with `state` (JSON), then tells the agent. Returns the directory.
    pub fn save_tensors(
        &mut self,
        step: u64,
        tensors: &[SnapshotTensor],
        state: Value,
    ) -> Result<PathBuf, WorkerError> {
        let staging = self.staging.clone().ok_or(WorkerError::NoStaging)?;
        let sizes: BTreeMap<String, u64> = tensors
            .iter()
            .map(|t| (t.name.clone(), t.data.len() as u64))
            .collect();
        let owner = assign_keys(&sizes, self.world_size);
        let mine: Vec<&SnapshotTensor> = tensors
            .iter()
            .filter(|t| owner.get(&t.name) == Some(&self.rank))
            .collect();
        let step_dir = staging.join(protocol::step_dir_name(step));
        let fin = step_dir.join(protocol::rank_dir_name(self.rank));
        let tmp = step_dir.join(format!(".rank-{}.tmp-{}", self.rank, std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(io("create", &tmp))?;
        let views = mine
            .iter()
            .map(|t| {
                TensorView::new(t.dtype, t.shape.clone(), &t.data)
                    .map(|v| (t.name.clone(), v))
                    .map_err(|e| WorkerError::Format {
                        path: tmp.clone(),
                        reason: format!("tensor {}: {e}", t.name),
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let tpath = tmp.join(STAGED_TENSORS);
        let info: HashMap<String, String> = [
            ("step".to_string(), step.to_string()),
            ("rank".to_string(), self.rank.to_string()),
        ]
        .into();
        safetensors::serialize_to_file(views, Some(info), &tpath).map_err(|e| {
            WorkerError::Format {
                path: tpath.clone(),
                reason: e.to_string(),
            }
        })?;
        let mut keys: Vec<String> = mine.iter().map(|t| t.name.clone()).collect();
        keys.sort_unstable();
        let meta = StagedMeta {
            format_version: FORMAT_VERSION,
            keys,
            rank: self.rank,
            state,
            step,
            world_size: self.world_size,
        };
        let mpath = tmp.join(STAGED_META);
        let text = serde_json::to_vec(&meta).map_err(|e| WorkerError::Format {
            path: mpath.clone(),
            reason: e.to_string(),
        })?;
        std::fs::write(&mpath, text).map_err(io("write", &mpath))?;
        for p in [&tpath, &mpath] {
            std::fs::File::open(p)
                .and_then(|f| f.sync_all())
                .map_err(io("fsync", p))?;
        }
        sync_dir(&tmp)?;
        let _ = std::fs::remove_dir_all(&fin);
        std::fs::rename(&tmp, &fin).map_err(io("rename", &tmp))?;
        sync_dir(&step_dir)?;
        if let Some(c) = self.conn.as_mut() {
            let dir = fin.to_string_lossy().into_owned();
            c.set_read_timeout_ms(SAVED_TIMEOUT_MS)?;
            let r = c.request(&Request::Saved {
                rank: self.rank,
                step,
                dir,
                last: self.stop_step.is_some_and(|s| step >= s),
            });
            c.set_read_timeout_ms(SOCKET_TIMEOUT_MS)?;
            r?;
        }
        Ok(fin)
    }

    /// The step the agent restored for this rank (`$ELASTIC_RESUME_DIR/rank-$RANK/`), or
    /// `None` when the job starts fresh. Restored without copies (`sources.json`), the
    /// tensors are read from the store's chunks that the agent checked.
    pub fn load_tensors(&self) -> Result<Option<Loaded>, WorkerError> {
        let Some(dir) = &self.resume_dir else {
            return Ok(None);
        };
        let mine = dir.join(protocol::rank_dir_name(self.rank));
        let meta_path = mine.join(RESTORED_META);
        let meta = read_json(&meta_path)?;
        let step = meta["step"].as_u64().ok_or_else(|| WorkerError::Format {
            path: meta_path.clone(),
            reason: "no step".into(),
        })?;
        let state = meta["metadata"]["state"].clone();
        let mut tpath = mine.join(RESTORED_TENSORS);
        let sources = mine.join(RESTORED_SOURCES);
        let bytes = if std::fs::symlink_metadata(&tpath).is_err() && sources.is_file() {
            // Restored without copies: the bytes lie in the store's chunks.
            let b = crate::sources::assemble(&sources, &read_json(&sources)?)?;
            tpath = sources;
            b
        } else {
            std::fs::read(&tpath).map_err(io("read", &tpath))?
        };
        let st = SafeTensors::deserialize(&bytes).map_err(|e| WorkerError::Format {
            path: tpath.clone(),
            reason: e.to_string(),
        })?;
        let tensors = st
            .tensors()
            .into_iter()
            .map(|(name, v)| SnapshotTensor {
                name,
                dtype: v.dtype(),
                shape: v.shape().to_vec(),
                data: v.data().to_vec(),
            })
            .collect();
        Ok(Some(Loaded {
            step,
            tensors,
            state,
        }))
    }
}

fn read_json(path: &Path) -> Result<Value, WorkerError> {
    let len = std::fs::metadata(path).map_err(io("stat", path))?.len();
    if len > METADATA_BYTES_MAX {
        return Err(WorkerError::Format {
            path: path.to_path_buf(),
            reason: format!("larger than {METADATA_BYTES_MAX} bytes"),
        });
    }
    let bytes = std::fs::read(path).map_err(io("read", path))?;
    serde_json::from_slice(&bytes).map_err(|e| WorkerError::Format {
        path: path.to_path_buf(),
        reason: format!("not JSON: {e}"),
    })
}

fn sync_dir(dir: &Path) -> Result<(), WorkerError> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io("fsync", dir))
}

/// Splits tensors between `world` ranks by bytes: largest first, each to the rank with the
/// fewest bytes so far (ties to the lower rank, then by name). Deterministic, and the same
/// split as the Python client's `assign_keys`.
pub fn assign_keys(sizes: &BTreeMap<String, u64>, world: u32) -> BTreeMap<String, u32> {
    let world = world.max(1) as usize;
    let mut load = vec![0u64; world];
    let mut order: Vec<(&String, u64)> = sizes.iter().map(|(k, v)| (k, *v)).collect();
    order.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
    let mut out = BTreeMap::new();
    for (k, size) in order {
        let r = (0..world)
            .min_by_key(|i| (load[*i], *i))
            .expect("world >= 1");
        out.insert(k.clone(), r as u32);
        load[r] += size;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keys_are_split_by_bytes_like_the_python_client() {
        let sizes: BTreeMap<String, u64> = [("a", 100), ("b", 60), ("c", 50), ("d", 10)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        let owner = assign_keys(&sizes, 2);
        // a -> 0 (0 bytes), b -> 1, c -> 1 (60 < 100), d -> 0 (100 < 110).
        assert_eq!(owner["a"], 0);
        assert_eq!(owner["b"], 1);
        assert_eq!(owner["c"], 1);
        assert_eq!(owner["d"], 0);
        assert!(assign_keys(&sizes, 1).values().all(|r| *r == 0));
    }

    #[test]
    fn each_key_goes_to_one_rank_and_loads_stay_within_one_tensor() {
        let sizes: BTreeMap<String, u64> = (0..50u64)
            .map(|i| (format!("t{i}"), i * 7919 % 1000 + 1))
            .collect();
        let largest = *sizes.values().max().unwrap();
        for world in [1u32, 2, 3, 8, 64] {
            let owner = assign_keys(&sizes, world);
            assert_eq!(owner.len(), sizes.len(), "world {world}");
            assert!(owner.values().all(|r| *r < world), "world {world}");
            let mut load = vec![0u64; world as usize];
            for (k, r) in &owner {
                load[*r as usize] += sizes[k];
            }
            let (lo, hi) = (load.iter().min().unwrap(), load.iter().max().unwrap());
            assert!(hi - lo <= largest, "world {world}: {load:?}");
            assert_eq!(owner, assign_keys(&sizes, world), "deterministic");
        }
    }

    #[test]
    fn should_checkpoint_follows_the_interval() {
        let mut w = Worker {
            rank: 0,
            local_rank: 0,
            world_size: 1,
            generation: 0,
            lr_scale: 2.0,
            grad_accum_steps: 1,
            checkpoint_interval: 5,
            resume_step: None,
            resume_dir: None,
            staging: None,
            conn: None,
            last_progress: None,
            checkpoint_at: Some(7),
            stop_step: None,
        };
        assert!(w.should_checkpoint(5));
        assert!(!w.should_checkpoint(6));
        assert!(w.should_checkpoint(7), "the agent's requested step");
        assert!(!w.should_checkpoint(8));
        assert_eq!(w.scaled_lr(0.5), 1.0);
        assert!(matches!(
            w.save_tensors(1, &[], json!({})),
            Err(WorkerError::NoStaging)
        ));
    }

    /// A stand-in agent on one end of a socket pair: every line must be a protocol request
    /// that reads back to the very same JSON (no field the protocol does not know); each is
    /// answered with `reply`. Returns the requests once the worker hangs up.
    fn fake_agent(
        stream: UnixStream,
        reply: impl Fn(&Request) -> protocol::Reply + Send + 'static,
    ) -> std::thread::JoinHandle<Vec<Request>> {
        std::thread::spawn(move || {
            let mut out = stream.try_clone().unwrap();
            let mut seen = Vec::new();
            for line in BufReader::new(stream).lines() {
                let line = line.unwrap();
                assert!(line.len() < MESSAGE_BYTES_MAX, "{line}");
                let sent: Value = serde_json::from_str(&line).unwrap();
                let req: Request =
                    serde_json::from_value(sent.clone()).unwrap_or_else(|e| panic!("{line}: {e}"));
                assert_eq!(serde_json::to_value(&req).unwrap(), sent, "{line}");
                let mut r = serde_json::to_string(&reply(&req)).unwrap();
                r.push('\n');
                out.write_all(r.as_bytes()).unwrap();
                seen.push(req);
            }
            seen
        })
    }

    #[test]
    fn a_worker_whose_node_joined_without_a_restore_asks_the_agent_for_its_step() {
        use protocol::Reply;
        let worker = |a: UnixStream| Worker {
            rank: 3,
            local_rank: 1,
            world_size: 4,
            generation: 5,
            lr_scale: 1.0,
            grad_accum_steps: 1,
            checkpoint_interval: 0,
            resume_step: None,
            resume_dir: None,
            staging: None,
            conn: Some(Conn {
                read: BufReader::new(a.try_clone().unwrap()),
                write: a,
            }),
            last_progress: None,
            checkpoint_at: None,
            stop_step: None,
        };
        // The step asked for did not verify: the agent gives the newest older one.
        let (a, b) = UnixStream::pair().unwrap();
        let agent = fake_agent(b, |_| Reply::Restored {
            step: 30,
            dir: "/s/.restore/step-30".into(),
        });
        let mut w = worker(a);
        w.restore_on_demand(40).unwrap();
        assert_eq!(w.resume_step, Some(30));
        assert_eq!(w.resume_dir, Some(PathBuf::from("/s/.restore/step-30")));
        drop(w);
        assert_eq!(
            agent.join().unwrap(),
            [Request::Restore { rank: 3, step: 40 }]
        );
        // A refusal, and a step newer than asked, are errors; nothing is taken.
        for reply in [
            Reply::Error {
                message: "the store is down".into(),
            },
            Reply::Restored {
                step: 41,
                dir: "/s/x".into(),
            },
        ] {
            let (a, b) = UnixStream::pair().unwrap();
            let agent = fake_agent(b, move |_| reply.clone());
            let mut w = worker(a);
            let e = w.restore_on_demand(40).unwrap_err();
            assert!(matches!(e, WorkerError::Agent(_)), "{e:?}");
            assert_eq!((w.resume_step, w.resume_dir.as_ref()), (None, None));
            drop(w);
            agent.join().unwrap();
        }
    }

    #[test]
    fn the_worker_sends_protocol_requests_and_reads_the_replies() {
        use protocol::Reply;
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        let agent = fake_agent(b, |req| match req {
            Request::Query {} => Reply::State {
                should_stop: true,
                should_checkpoint_at: Some(6),
                generation: 2,
            },
            Request::PeerStop { .. } => Reply::Error {
                message: "not now".into(),
            },
            _ => Reply::Ok,
        });
        let read = BufReader::new(a.try_clone().unwrap());
        let mut w = Worker {
            rank: 1,
            local_rank: 1,
            world_size: 2,
            generation: 2,
            lr_scale: 1.0,
            grad_accum_steps: 1,
            checkpoint_interval: 0,
            resume_step: None,
            resume_dir: None,
            staging: Some(tmp.path().to_path_buf()),
            conn: Some(Conn { write: a, read }),
            last_progress: None,
            checkpoint_at: None,
            stop_step: None,
        };
        w.report_progress(3).unwrap();
        assert!(w.should_stop(4).unwrap());
        assert!(!w.should_checkpoint(5));
        assert!(w.should_checkpoint(6), "the step the agent asked for");
        match w.peer_stop(7) {
            Err(WorkerError::Agent(m)) => assert_eq!(m, "not now"),
            other => panic!("{other:?}"),
        }
        let tensor = |name: &str, n: usize| SnapshotTensor {
            name: name.into(),
            dtype: Dtype::F32,
            shape: vec![n],
            data: vec![0; 4 * n],
        };
        let dir = w
            .save_tensors(8, &[tensor("a", 2), tensor("b", 1)], json!({"pos": 8}))
            .unwrap();
        drop(w);
        let seen = agent.join().unwrap();
        assert_eq!(dir, tmp.path().join("step-8/rank-1"));
        assert_eq!(
            seen,
            [
                Request::Progress { rank: 1, step: 3 },
                Request::Query {},
                Request::PeerStop { rank: 1, step: 7 },
                Request::Saved {
                    rank: 1,
                    step: 8,
                    dir: dir.to_string_lossy().into_owned(),
                    last: true,
                },
            ]
        );
        let meta: StagedMeta =
            serde_json::from_slice(&std::fs::read(dir.join(STAGED_META)).unwrap()).unwrap();
        // Split by bytes: "a" (8 bytes) is rank 0's, "b" rank 1's.
        assert_eq!(
            meta,
            StagedMeta {
                format_version: FORMAT_VERSION,
                keys: vec!["b".into()],
                rank: 1,
                state: json!({"pos": 8}),
                step: 8,
                world_size: 2,
            }
        );
        let bytes = std::fs::read(dir.join(STAGED_TENSORS)).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.names(), ["b"]);
    }
}
