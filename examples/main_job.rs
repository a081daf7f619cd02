//! The main job: a real elastic training run on this machine.
//!
//! Starts a local etcd, then three `elastic-run` agents as three simulated nodes (distinct
//! node ids and staging dirs) training `examples/ddp_train.py` data-parallel with PyTorch gloo,
//! two workers each, checkpointing to a `file://` bucket. During the run it preempts one node
//! (SIGTERM: the node drains, every rank saves the same step, no step is lost) and then kills
//! another outright (SIGKILL: the survivor resumes from the newest committed step). At the end
//! it prints the generations, world sizes, learning rates, checkpoints and lost steps.
//!
//! `examples/main-job.sh` builds and runs it; everything is on embedded defaults.
//! Environment knobs: `MAIN_JOB_STEPS` (default 300), `MAIN_JOB_DIR` (default
//! `target/main-job`; wiped at start; the bucket and logs stay there afterwards).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

const NODES: [&str; 3] = ["node-a", "node-b", "node-c"];
const NPROC: u32 = 2;
const BASE_LR: f64 = 0.05;
const CHECKPOINT_INTERVAL: u64 = 10;
/// The threads copying agents' output into the logs.
static FOLLOWERS: std::sync::Mutex<Vec<std::thread::JoinHandle<()>>> =
    std::sync::Mutex::new(Vec::new());
const PHASE_LIMIT: Duration = Duration::from_secs(300);

struct Agent {
    node: &'static str,
    child: Child,
}

fn main() -> Result<()> {
    let repo = std::fs::canonicalize(services::paths::repo_root())?;
    let steps: u64 = std::env::var("MAIN_JOB_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    let dir = std::env::var_os("MAIN_JOB_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo.join("target/main-job"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("logs"))?;
    let bin = repo.join("target/debug/elastic-run");
    if !bin.exists() {
        bail!(
            "{} not found: build it with `cargo build -p runtime`",
            bin.display()
        );
    }
    let bucket = format!("file://{}", dir.join("bucket").display());
    let events = dir.join("events.jsonl");

    println!("== starting etcd (local, temporary)");
    let etcd = services::etcd().context("start etcd")?;
    println!("   etcd at {}", etcd.endpoint());
    println!(
        "== starting {} nodes x {NPROC} workers: examples/ddp_train.py, {steps} steps, bucket {bucket}",
        NODES.len()
    );
    let t0 = Instant::now();
    let rank0_step = Arc::new(AtomicU64::new(0));
    let start = |node: &'static str| -> Result<Agent> {
        let mut c = Command::new(&bin);
        c.args([
            "--nnodes",
            "1:3",
            "--nproc-per-node",
            &NPROC.to_string(),
            "--rdzv-backend",
            "etcd-v3",
            "--rdzv-endpoint",
            &etcd.host_port(),
            "--rdzv-id",
            "main-job",
            "--node-id",
            node,
            "--local-addr",
            "127.0.0.1",
            "--rdzv-conf",
            "lease_ttl_ms=3000,settle_ms=500",
            "--checkpoint-url",
            &bucket,
            "--checkpoint-interval",
            &CHECKPOINT_INTERVAL.to_string(),
            "--lr-scaling",
            "linear",
            "--base-world-size",
            "6",
            "--batch-size",
            "16",
            "--base-lr",
            &BASE_LR.to_string(),
            "--preemption-grace",
            "30s",
        ])
        .arg("--staging-dir")
        .arg(dir.join(format!("staging-{node}")))
        .arg("--events-file")
        .arg(&events)
        // Workers' lines are read back by rank: teed, prefixed `[rank N] `, and kept in files.
        .args(["--tee", "3", "--log-dir"])
        .arg(dir.join(format!("logs/{node}.workers")))
        .arg("--")
        .arg(services::paths::python()?)
        .arg(repo.join("examples/ddp_train.py"))
        .args(["--steps", &steps.to_string(), "--step-sleep", "0.05"])
        .env("ELASTIC_LOG", "info")
        .env("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank ${rank}] ")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(
            dir.join(format!("logs/{node}.agent.log")),
        )?);
        let mut child = c.spawn().with_context(|| format!("start {node}"))?;
        follow(
            node,
            child.stdout.take().expect("piped"),
            &dir.join(format!("logs/{node}.workers.log")),
            rank0_step.clone(),
        )?;
        Ok(Agent { node, child })
    };
    // node-a first, so it holds rank 0 (survivors keep their order): its workers' output is the
    // one the summary reads.
    let mut agents = vec![start(NODES[0])?];
    wait_event(&events, "node-a to join", &|e| e["event"] == "joined")?;
    for node in &NODES[1..] {
        agents.push(start(node)?);
    }

    let ev = |pred: &dyn Fn(&Value) -> bool, what: &str| wait_event(&events, what, pred);
    ev(
        &|e| e["event"] == "generation" && e["world_size"] == 6,
        "the first generation",
    )?;
    ev(
        &|e| {
            e["event"] == "checkpoint_committed"
                && e["step"].as_u64() >= Some(2 * CHECKPOINT_INTERVAL)
        },
        "two checkpoints",
    )?;

    let mut faults: Vec<(String, &'static str, f64)> = vec![];
    println!(
        "\n== preempting node-c (SIGTERM, grace 30 s) at step {}",
        rank0_step.load(Ordering::Relaxed)
    );
    faults.push((
        "preempt (SIGTERM)".into(),
        "node-c",
        t0.elapsed().as_secs_f64(),
    ));
    signal(&agents[2].child, libc::SIGTERM);
    let status = agents[2].child.wait()?;
    println!("   node-c left with {status}");
    ev(
        &|e| e["event"] == "first_step" && world_of(&events, e) == Some(4),
        "the survivors' first step at world 4",
    )?;
    ev(
        &|e| {
            e["event"] == "checkpoint_committed"
                && gen_world(&events, e["generation"].as_u64()) == Some(4)
        },
        "a checkpoint at world 4",
    )?;

    println!(
        "\n== killing node-b (SIGKILL, no warning) at step {}",
        rank0_step.load(Ordering::Relaxed)
    );
    faults.push((
        "kill (SIGKILL)".into(),
        "node-b",
        t0.elapsed().as_secs_f64(),
    ));
    signal(&agents[1].child, libc::SIGKILL);
    agents[1].child.wait()?;

    let deadline = Instant::now() + Duration::from_secs(600);
    let status = loop {
        if let Some(s) = agents[0].child.try_wait()? {
            break s;
        }
        if Instant::now() > deadline {
            for a in &mut agents {
                eprintln!("stopping {}", a.node);
                let _ = a.child.kill();
            }
            bail!("node-a did not finish within 10 minutes");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let elapsed = t0.elapsed().as_secs_f64();
    println!("\n== node-a finished with {status} after {elapsed:.1} s");
    drop(etcd);
    // Every agent has exited: let the followers copy the last lines before they are read.
    for h in std::mem::take(&mut *FOLLOWERS.lock().expect("followers")) {
        let _ = h.join();
    }
    summary(&events, &faults, &dir, t0, steps)?;
    if !status.success() {
        bail!(
            "the job did not finish cleanly (see {})",
            dir.join("logs").display()
        );
    }
    Ok(())
}

/// Copies an agent's worker output to a log, prints the interesting lines, and tracks rank
/// 0's step.
fn follow(
    node: &'static str,
    out: impl std::io::Read + Send + 'static,
    log: &Path,
    step: Arc<AtomicU64>,
) -> Result<()> {
    let mut file = std::fs::File::create(log)?;
    let handle = std::thread::spawn(move || {
        use std::io::Write;
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { return };
            let _ = writeln!(file, "{line}");
            if let Some(rest) = line.strip_prefix("[rank 0] step ") {
                let n: u64 = rest
                    .split_whitespace()
                    .next()
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0);
                step.fetch_max(n, Ordering::Relaxed);
                if n.is_multiple_of(25) {
                    println!("   {node} {line}");
                }
            } else if line.contains("resumed from")
                || line.contains("stopping at")
                || line.contains("done step")
            {
                println!("   {node} {line}");
            }
        }
    });
    FOLLOWERS.lock().expect("followers").push(handle);
    Ok(())
}

fn read_events(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn wait_event(path: &Path, what: &str, pred: &dyn Fn(&Value) -> bool) -> Result<Value> {
    let deadline = Instant::now() + PHASE_LIMIT;
    loop {
        if let Some(e) = read_events(path).into_iter().find(|e| pred(e)) {
            return Ok(e);
        }
        if Instant::now() > deadline {
            bail!("waited {PHASE_LIMIT:?} for {what}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn gen_world(path: &Path, generation: Option<u64>) -> Option<u64> {
    let g = generation?;
    read_events(path)
        .into_iter()
        .find(|e| e["event"] == "generation" && e["generation"].as_u64() == Some(g))
        .and_then(|e| e["world_size"].as_u64())
}

fn world_of(path: &Path, e: &Value) -> Option<u64> {
    gen_world(path, e["generation"].as_u64())
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(child.id() as i32, sig) };
}

fn summary(
    path: &Path,
    faults: &[(String, &str, f64)],
    dir: &Path,
    t0: Instant,
    steps: u64,
) -> Result<()> {
    let events = read_events(path);
    let start_ms = events
        .first()
        .and_then(|e| e["ts_ms"].as_u64())
        .unwrap_or(0);
    let _ = t0;
    let secs = |e: &Value| {
        (e["ts_ms"]
            .as_u64()
            .unwrap_or(start_ms)
            .saturating_sub(start_ms)) as f64
            / 1000.0
    };
    println!("\n================ what happened ================");
    println!("generations (as node-a saw them):");
    println!(
        "  {:>4} {:>7} {:>6} {:>9} {:>8} {:>7}  members",
        "gen", "t (s)", "world", "lr scale", "lr", "resume"
    );
    let gens: Vec<&Value> = events
        .iter()
        .filter(|e| e["event"] == "generation" && e["node"] == "node-a")
        .collect();
    for g in &gens {
        println!(
            "  {:>4} {:>7.1} {:>6} {:>9.4} {:>8.5} {:>7}  {}",
            g["generation"],
            secs(g),
            g["world_size"],
            g["lr_scale"].as_f64().unwrap_or(0.0),
            g["lr"].as_f64().unwrap_or(0.0),
            g["resume_step"]
                .as_u64()
                .map_or("-".into(), |s| s.to_string()),
            g["members"]
                .as_array()
                .map(|m| m
                    .iter()
                    .filter_map(|x| x.as_str())
                    .collect::<Vec<_>>()
                    .join(","))
                .unwrap_or_default()
        );
    }
    let mut committed: Vec<u64> = events
        .iter()
        .filter(|e| e["event"] == "checkpoint_committed" && e["by_this_node"] == true)
        .filter_map(|e| e["step"].as_u64())
        .collect();
    committed.sort_unstable();
    committed.dedup();
    println!(
        "checkpoints committed: {} steps: {:?}",
        committed.len(),
        committed
    );

    // Lost work per fault: the highest step trained before the next generation started,
    // minus the step that generation resumed from.
    println!("faults:");
    let log = std::fs::read_to_string(dir.join("logs/node-a.workers.log")).unwrap_or_default();
    let mut reached_per_gen: std::collections::BTreeMap<u64, u64> = Default::default();
    let mut gen_idx = 0usize;
    for line in log.lines() {
        if line.contains("resumed from step") {
            gen_idx += 1;
        }
        if let Some(rest) = line.strip_prefix("[rank 0] step ") {
            let n: u64 = rest
                .split_whitespace()
                .next()
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            let e = reached_per_gen.entry(gen_idx as u64).or_default();
            *e = (*e).max(n);
        }
    }
    let mut total_lost = 0;
    for (i, (what, node, at)) in faults.iter().enumerate() {
        // Generation i+1 (0-based in gens) is the one formed after fault i.
        let next = gens.get(i + 1);
        let resume = next.and_then(|g| g["resume_step"].as_u64());
        let reached = reached_per_gen.get(&(i as u64)).copied();
        let lost = match (reached, resume) {
            (Some(r), Some(s)) => r.saturating_sub(s),
            _ => 0,
        };
        total_lost += lost;
        let recovery = next
            .and_then(|g| {
                events.iter().find(|e| {
                    e["event"] == "first_step"
                        && e["node"] == "node-a"
                        && e["generation"] == g["generation"]
                })
            })
            .map(|e| secs(e) - at)
            .map_or("-".into(), |s| format!("{s:.1} s"));
        println!(
            "  {what:<18} {node} at {at:>5.1} s: trained to step {}, resumed from {}, lost {lost} step(s), survivors training again after {recovery}",
            reached.map_or("-".into(), |s| s.to_string()),
            resume.map_or("-".into(), |s| s.to_string()),
        );
    }
    let done = log
        .lines()
        .rev()
        .find(|l| l.contains("done step"))
        .unwrap_or("(no final line)");
    println!("result: {done}");
    println!("lost steps in total: {total_lost} (of {steps})");
    println!(
        "bucket: {} (inspect it with `target/debug/elastic-ckpt ls file://{}/bucket`)",
        dir.join("bucket").display(),
        dir.display()
    );
    println!("logs:   {}", dir.join("logs").display());
    Ok(())
}
