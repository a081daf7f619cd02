//! Runs one scenario: starts etcd (and moto for S3 scenarios) on loopback, a fault proxy in
//! front of etcd for every node and one in front of the store, N `elastic-run` agents as
//! simulated nodes, injects the scheduled faults, waits for the job, then checks the
//! invariants and writes the report.
//!
//! With `network = "netns"` every node runs in a network namespace of its own (see
//! [`crate::netns`]) with a real address: its agent advertises that address, its workers talk
//! gloo over the bridge, and it reaches etcd, the store and its notice server through sockets the
//! harness opens inside its namespace. A partition then also takes its link down.
//!
//! Layout: this file has the scenario's run loop ([`run`]: the reference run, the services,
//! the nodes one after another, the fault schedule, the end state, the checks and the
//! report); `nodes.rs` starts and follows the simulated nodes (agents, etcd proxies, notice
//! servers); `faults.rs` injects each fault (`mounts.rs`: the staging tmpfs mounts);
//! `procs.rs` finds and signals processes; `end_state.rs` reads what a run left (final line,
//! error messages, the store verified and restored).

mod end_state;
mod faults;
mod mounts;
mod nodes;
mod procs;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

pub use crate::events::read_events;
use crate::events::{Event, EventLog, Record};
use crate::invariants::{self, Fired, Outcome};
use crate::netns::Network;
use crate::proxy::Proxy;
use crate::report::{self, Report};
use crate::scenario::{self as sc, Fault, FaultKind, Scenario, StoreKind, schedule};
use end_state::{check_store, failure_message, final_line, lines_holding, store_options};
use mounts::Mounts;
use nodes::Run;
pub use procs::{children, leftovers, workers};

/// How long the job may take to reach its first training step.
const FIRST_STEP_TIMEOUT_MS: u64 = 180_000;
/// How long to wait for processes to go away at the end before calling them leftovers.
const LEFTOVER_GRACE_MS: u64 = 3_000;
const POLL_MS: u64 = 50;

/// Where the tools are.
#[derive(Debug, Clone)]
pub struct Tools {
    pub elastic_run: PathBuf,
    pub python: PathBuf,
    /// The default training script (a scenario's `example` overrides it).
    pub example: PathBuf,
    pub repo: PathBuf,
}

impl Tools {
    /// The repository's build and `.venv`: `$ELASTIC_RUN_BIN`, else `target/debug/elastic-run`.
    pub fn from_repo() -> Result<Tools> {
        Tools::resolve(None)
    }

    /// Like [`Tools::from_repo`], with the agent binary given (relative paths are taken from
    /// the current directory). Paths are checked by [`Tools::for_scenario`].
    pub fn resolve(elastic_run: Option<&Path>) -> Result<Tools> {
        let repo = services::paths::repo_root();
        let elastic_run = elastic_run
            .map(Path::to_path_buf)
            .or_else(|| std::env::var_os("ELASTIC_RUN_BIN").map(PathBuf::from))
            .unwrap_or_else(|| repo.join("target/debug/elastic-run"));
        Ok(Tools {
            elastic_run,
            python: services::paths::python()?,
            example: repo.join("examples/ddp_train.py"),
            repo,
        })
    }

    /// The tools for scenario `s`: its `elastic_run` (relative to the repository) unless
    /// `explicit` (a command-line override) is set, and its `example`. Checks that they exist.
    pub fn for_scenario(&self, s: &Scenario, explicit: bool) -> Result<Tools> {
        let mut t = self.clone();
        if !explicit && let Some(bin) = &s.elastic_run {
            t.elastic_run = t.repo.join(bin);
        }
        if let Some(ex) = &s.example {
            t.example = t.repo.join(ex);
        }
        t.check()?;
        Ok(t)
    }

    fn check(&self) -> Result<()> {
        if !self.elastic_run.exists() {
            bail!(
                "{} not found: build it with `cargo build -p runtime --bin elastic-run` (or pass \
                 --elastic-run PATH, or set ELASTIC_RUN_BIN)",
                self.elastic_run.display()
            );
        }
        if !self.example.exists() {
            bail!("training script {} not found", self.example.display());
        }
        Ok(())
    }
}

/// Where a run keeps its newest committed step, restored for one rank of a world of one.
pub const FINAL_STATE_DIR: &str = "final-state";

/// Runs `s` with `seed` into `out` (wiped first); returns the report (also written there).
/// With `compare_reference`, a fault-free run of the same scenario goes first, into
/// `out/reference`.
pub async fn run(s: &Scenario, seed: u64, tools: &Tools, out: &Path) -> Result<Report> {
    if out.exists() {
        std::fs::remove_dir_all(out)
            .with_context(|| format!("clear {} (a staging tmpfs still mounted?)", out.display()))?;
    }
    std::fs::create_dir_all(out)?;
    // What ran, seed included: `elastic-chaos run OUT/scenario.toml` replays it.
    let mut replay = s.clone();
    replay.seed = Some(seed);
    std::fs::write(
        out.join("scenario.toml"),
        toml::to_string(&replay).context("scenario as TOML")?,
    )?;
    let reference = if s.compare_reference {
        let mut clean = s.clone();
        clean.faults.clear();
        clean.random = None;
        clean.compare_reference = false;
        let r = Box::pin(run_once(&clean, seed, tools, &out.join("reference"), None)).await?;
        if !r.passed {
            bail!(
                "the fault-free reference run failed: see {}",
                out.join("reference").display()
            );
        }
        Some(Reference {
            digest: r.outcome.digest,
            state: out.join("reference").join(FINAL_STATE_DIR),
        })
    } else {
        None
    };
    run_once(s, seed, tools, out, reference).await
}

/// What the fault-free reference run left to compare against.
struct Reference {
    digest: Option<String>,
    /// Its newest committed step, restored whole.
    state: PathBuf,
}

async fn run_once(
    s: &Scenario,
    seed: u64,
    tools: &Tools,
    out: &Path,
    reference: Option<Reference>,
) -> Result<Report> {
    let started = Instant::now();
    std::fs::create_dir_all(out)?;
    let out = std::fs::canonicalize(out)?;
    let job = format!("chaos-{}-{seed}-{}", sanitize(&s.name), std::process::id());
    let faults = schedule(s, seed);
    tracing::info!(scenario = %s.name, seed, faults = faults.len(), "run starts");
    std::fs::write(
        out.join("schedule.json"),
        serde_json::to_vec_pretty(&faults)?,
    )?;

    // On this worker thread, not the blocking pool: services die with the thread that started
    // them (PR_SET_PDEATHSIG), and blocking-pool threads exit when idle.
    let etcd = tokio::task::block_in_place(services::etcd)?;
    let mut moto = None;
    let (url, env, store_proxy) = match s.store {
        StoreKind::File => (format!("file://{}/bucket", out.display()), vec![], None),
        StoreKind::S3 => {
            let m = tokio::task::block_in_place(services::moto)?;
            m.create_bucket("chaos")?;
            let proxy = Proxy::start(m.service.addr()).await?;
            let mut env = m.env();
            for (k, v) in env.iter_mut() {
                if k == "AWS_ENDPOINT" {
                    *v = format!("http://{}", proxy.addr);
                }
            }
            moto = Some(m);
            (format!("s3://chaos/{job}"), env, Some(proxy))
        }
    };
    let net = match s.network {
        sc::Network::Loopback => None,
        sc::Network::Netns => Some(
            tokio::task::block_in_place(Network::create)
                .with_context(|| format!("scenario {}: network = \"netns\"", s.name))?,
        ),
    };
    let mut small_staging: Vec<usize> = faults
        .iter()
        .filter(|f| f.kind == FaultKind::StagingFull)
        .map(|f| f.node)
        .collect();
    small_staging.dedup();
    let mut run = Run {
        s,
        tools,
        out: out.clone(),
        job: job.clone(),
        url: url.clone(),
        env: env.clone(),
        etcd: Arc::new(Mutex::new(etcd)),
        store_proxy,
        net,
        nodes: vec![],
        small_staging,
        mounts: Mounts::default(),
        keepers: Vec::new(),
    };
    // The store watcher talks to the store directly (never through the fault proxy).
    let direct_opts = match &moto {
        Some(m) => {
            let mut direct = env.clone();
            for (k, v) in direct.iter_mut() {
                if k == "AWS_ENDPOINT" {
                    *v = m.endpoint();
                }
            }
            store_options(&direct)
        }
        None => vec![],
    };
    let watch_stop = checkpoint::CancellationToken::new();
    let watcher = tokio::spawn(crate::watch::watch(
        checkpoint::Store::open_with_options(&url, direct_opts.clone())
            .with_context(|| format!("open {url}"))?,
        Instant::now(),
        watch_stop.clone(),
    ));
    // Stops the watcher however this function ends.
    let _watch_guard = watch_stop.clone().drop_guard();
    // Nodes start one after another, so ranks follow node order.
    for i in 0..s.nodes {
        run.start_node(i).await?;
        let name = format!("node{i}");
        let deadline = Instant::now() + Duration::from_millis(FIRST_STEP_TIMEOUT_MS);
        while !run
            .events()
            .records
            .iter()
            .any(|e| matches!(e.event, Event::Joined { .. }) && e.node == name)
        {
            if Instant::now() > deadline || run.all_exited() {
                bail!("{name} did not join: see {}", out.join("logs").display());
            }
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    }
    // Faults count from the first training step.
    let deadline = Instant::now() + Duration::from_millis(FIRST_STEP_TIMEOUT_MS);
    while !run
        .events()
        .records
        .iter()
        .any(|e| matches!(e.event, Event::FirstStep { .. }))
    {
        if Instant::now() > deadline {
            bail!(
                "no training step within {FIRST_STEP_TIMEOUT_MS} ms: see {}",
                out.join("logs").display()
            );
        }
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
    let t0 = Instant::now();
    let end = started + Duration::from_secs_f64(s.deadline_s);
    let mut fired = Vec::new();
    let mut pending: std::collections::VecDeque<Fault> = faults.into();
    let mut timed_out = false;
    loop {
        if let Some(f) = pending.front()
            && t0.elapsed() >= Duration::from_millis(f.at_ms)
        {
            let f = pending.pop_front().expect("front");
            let at_unix_ms = unix_ms();
            let skipped = run.inject(&f).await?;
            if let Some(why) = &skipped {
                tracing::warn!(kind = ?f.kind, node = f.node, "fault skipped: {why}");
            }
            fired.push(Fired {
                at_unix_ms,
                fault: f,
                skipped,
            });
            continue;
        }
        if run.all_exited() {
            break;
        }
        if Instant::now() > end {
            timed_out = true;
            tracing::error!("deadline passed; killing the agents");
            for n in &mut run.nodes {
                if let Some(c) = n.child.as_mut() {
                    let _ = c.kill();
                }
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
    let run_end_unix_ms = unix_ms();
    let mut exits = Vec::new();
    let mut failure_messages = Vec::new();
    for n in &mut run.nodes {
        let code = n
            .child
            .as_mut()
            .and_then(|c| c.wait().ok())
            .and_then(|s| s.code());
        exits.push((n.name.clone(), if n.removed { None } else { code }));
        if let Some(m) = failure_message(&out.join(format!("logs/{}.err", n.name))) {
            failure_messages.push((n.name.clone(), m));
        }
    }
    // Leftovers: every process of this job should be gone.
    let mut left = leftovers(&job);
    let grace = Instant::now() + Duration::from_millis(LEFTOVER_GRACE_MS);
    while !left.is_empty() && Instant::now() < grace {
        tokio::time::sleep(Duration::from_millis(100)).await;
        left = leftovers(&job);
    }
    watch_stop.cancel();
    let live = watcher.await.unwrap_or_default();
    let (committed, bad_steps) = check_store(&url, direct_opts, &out).await;
    let (done_step, digest) = final_line(&out.join("logs"));
    let expected_output = lines_holding(&out.join("logs"), &s.expect_output);
    let (reference_digest, weights) = match reference {
        Some(r) => {
            let diff = crate::weights::compare(&out.join(FINAL_STATE_DIR), &r.state)
                .map_err(|e| format!("{e:#}"));
            (r.digest, Some(diff))
        }
        None => (None, None),
    };
    // The log as the agents left it: its unreadable lines fail the run (a check), the lines
    // of agents killed while writing are only listed.
    let EventLog {
        records: events,
        unreadable: unreadable_events,
        truncated: truncated_events,
    } = run.events();
    for l in &unreadable_events {
        tracing::error!("event log line that is no record: {l}");
    }
    for l in &truncated_events {
        tracing::warn!("event log line cut off by a killed agent (tolerated): {l}");
    }
    let outcome = Outcome {
        done_step,
        digest,
        weights,
        exits,
        timed_out,
        committed,
        bad_steps,
        leftovers: left,
        reference_digest,
        live,
        failure_messages,
        expected_output,
        unreadable_events,
        truncated_events,
    };
    let checks = invariants::check(s, &events, &fired, &outcome);
    let passed = checks.iter().all(|c| c.ok);
    let mut generations: BTreeMap<u64, Record> = BTreeMap::new();
    for e in &events {
        if let Event::Generation { generation, .. } = e.event {
            generations.entry(generation).or_insert_with(|| e.clone());
        }
    }
    let report = Report {
        scenario: s.name.clone(),
        seed,
        job,
        wall_ms: started.elapsed().as_millis() as u64,
        faults: invariants::effects(&events, &fired),
        generations: generations.into_values().collect(),
        checks,
        outcome,
        passed,
    };
    std::fs::write(out.join("report.json"), serde_json::to_vec_pretty(&report)?)?;
    std::fs::write(
        out.join("timeline.svg"),
        report::timeline_svg(
            &format!("{} (seed {seed})", s.name),
            &events,
            &fired,
            Some(run_end_unix_ms),
        ),
    )?;
    drop(run);
    drop(moto);
    Ok(report)
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect()
}
