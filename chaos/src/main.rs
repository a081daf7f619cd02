//! `elastic-chaos run SCENARIO.toml [--seed N] [--out DIR] [--in-place]` and
//! `elastic-chaos soak --minutes N [--out DIR]`. See the `chaos` crate docs.

use std::future::Future;
use std::path::PathBuf;
use std::process::ExitCode;

use chaos::harness::{self, Tools};
use chaos::scenario::{Scenario, random_scenario};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "elastic-chaos",
    about = "Kill nodes on purpose; prove that nothing is lost"
)]
struct Cli {
    /// The agent binary; default: the scenario's `elastic_run`, else target/debug/elastic-run.
    #[arg(long, global = true, env = "ELASTIC_RUN_BIN")]
    elastic_run: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run one scenario and check the invariants.
    Run {
        scenario: PathBuf,
        /// Overrides the scenario's seed (default: the scenario's, else random).
        #[arg(long)]
        seed: Option<u64>,
        #[arg(long, default_value = "target/chaos")]
        out: PathBuf,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// Run the scenario's nodes with `--in-place` (if its `args` do not already).
        #[arg(long)]
        in_place: bool,
    },
    /// Random scenarios until the time is up; stops at the first violated invariant.
    Soak {
        #[arg(long)]
        minutes: f64,
        #[arg(long, default_value = "target/chaos-soak")]
        out: PathBuf,
        #[arg(long)]
        seed: Option<u64>,
        /// auto: half the scenarios in network namespaces when they can be made here (root),
        /// loopback: none, netns: half, and fail if they cannot be made.
        #[arg(long, value_enum, default_value = "auto")]
        network: SoakNetwork,
        /// Run every drawn scenario's nodes with `--in-place`: the workers switch to a new
        /// generation without a restart where they can.
        #[arg(long)]
        in_place: bool,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum SoakNetwork {
    Auto,
    Loopback,
    Netns,
}

fn random_seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ (u64::from(std::process::id()) << 32)
}

/// Characters of a check's detail printed on the console; report.json has all of it.
const DETAIL_CHARS_MAX: usize = 600;

fn shorten(detail: &str) -> String {
    let n = detail.chars().count();
    if n <= DETAIL_CHARS_MAX {
        return detail.to_string();
    }
    let head: String = detail.chars().take(DETAIL_CHARS_MAX).collect();
    format!(
        "{head}... ({} more characters in report.json)",
        n - DETAIL_CHARS_MAX
    )
}

fn print_report(r: &chaos::report::Report, out: &std::path::Path) {
    println!(
        "scenario {} seed {}: {}",
        r.scenario,
        r.seed,
        if r.passed { "PASSED" } else { "FAILED" }
    );
    for f in &r.faults {
        println!(
            "  fault {:?} on node{}: detected after {:?} ms, training again after {:?} ms, lost {:?} step(s)",
            f.kind, f.node, f.detection_ms, f.recovery_ms, f.lost_steps
        );
    }
    for c in &r.checks {
        println!(
            "  [{}] {}: {}",
            if c.ok { "ok" } else { "VIOLATED" },
            c.name,
            shorten(&c.detail)
        );
    }
    println!(
        "  report {}/report.json, timeline {}/timeline.svg",
        out.display(),
        out.display()
    );
}

/// Exit status after SIGINT or SIGTERM: 128 + SIGINT, as a shell reports an interrupted command.
const EXIT_INTERRUPTED: u8 = 130;

/// SIGINT and SIGTERM, listened to for the whole life of the harness so that a signal that comes
/// between two soak runs is not missed.
struct Stop {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

impl Stop {
    fn listen(rt: &tokio::runtime::Runtime) -> std::io::Result<Stop> {
        use tokio::signal::unix::{SignalKind, signal};
        let _in_rt = rt.enter();
        Ok(Stop {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
        })
    }

    /// Runs `run` to its end, or until SIGINT or SIGTERM: then `run` is dropped, and with it
    /// the run's agents (killed and reaped; their workers die with them), services, namespaces
    /// and mounts, and the signal's name is returned.
    fn run_until_signal<F: Future>(
        &mut self,
        rt: &tokio::runtime::Runtime,
        run: F,
    ) -> Result<F::Output, &'static str> {
        rt.block_on(async {
            tokio::select! {
                out = run => Ok(out),
                _ = self.interrupt.recv() => Err("SIGINT"),
                _ = self.terminate.recv() => Err("SIGTERM"),
            }
        })
    }
}

fn interrupted(signal: &str) -> ExitCode {
    eprintln!("elastic-chaos: interrupted by {signal}; the run's processes are stopped");
    ExitCode::from(EXIT_INTERRUPTED)
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ELASTIC_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("elastic-chaos: {e}");
            return ExitCode::from(1);
        }
    };
    let mut stop = match Stop::listen(&rt) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("elastic-chaos: listening for SIGINT and SIGTERM: {e}");
            return ExitCode::from(1);
        }
    };
    let explicit_bin = cli.elastic_run.is_some();
    let tools = match Tools::resolve(cli.elastic_run.as_deref()) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("elastic-chaos: {e:#}");
            return ExitCode::from(2);
        }
    };
    match cli.cmd {
        Cmd::Run {
            scenario,
            seed,
            out,
            json,
            in_place,
        } => {
            let text = match std::fs::read_to_string(&scenario) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("elastic-chaos: {}: {e}", scenario.display());
                    return ExitCode::from(2);
                }
            };
            let mut s = match Scenario::parse(&text, &scenario.display().to_string()) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("elastic-chaos: {e:#}");
                    return ExitCode::from(2);
                }
            };
            if in_place && !s.args.iter().any(|a| a == "--in-place") {
                s.args.push("--in-place".into());
            }
            let tools = match tools.for_scenario(&s, explicit_bin) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("elastic-chaos: {e:#}");
                    return ExitCode::from(2);
                }
            };
            let seed = seed.or(s.seed).unwrap_or_else(random_seed);
            println!(
                "scenario {} seed {seed} (replay with --seed {seed})",
                s.name
            );
            let out = out.join(&s.name);
            let run = match stop.run_until_signal(&rt, harness::run(&s, seed, &tools, &out)) {
                Ok(run) => run,
                Err(signal) => return interrupted(signal),
            };
            match run {
                Ok(r) => {
                    if json {
                        println!("{}", serde_json::to_string_pretty(&r).unwrap_or_default());
                    } else {
                        print_report(&r, &out);
                    }
                    if r.passed {
                        ExitCode::SUCCESS
                    } else {
                        ExitCode::from(1)
                    }
                }
                Err(e) => {
                    eprintln!("elastic-chaos: run failed: {e:#}");
                    ExitCode::from(1)
                }
            }
        }
        Cmd::Soak {
            minutes,
            out,
            seed,
            network,
            in_place,
        } => {
            let netns_ok = match network {
                SoakNetwork::Loopback => false,
                SoakNetwork::Auto | SoakNetwork::Netns => match chaos::netns::available() {
                    Ok(()) => true,
                    Err(e) if network == SoakNetwork::Auto => {
                        println!("soak: every node on loopback (no network namespaces: {e:#})");
                        false
                    }
                    Err(e) => {
                        eprintln!("elastic-chaos: {e:#}");
                        return ExitCode::from(2);
                    }
                },
            };
            let tools = match tools.for_scenario(&random_scenario(0, netns_ok), explicit_bin) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("elastic-chaos: {e:#}");
                    return ExitCode::from(2);
                }
            };
            let until = std::time::Instant::now()
                + std::time::Duration::from_secs_f64(minutes.max(0.0) * 60.0);
            let mut seed = seed.unwrap_or_else(random_seed);
            let mut n = 0;
            while std::time::Instant::now() < until {
                let mut s = random_scenario(seed, netns_ok);
                if in_place {
                    s.name = "soak-in-place".into();
                    s.args.push("--in-place".into());
                }
                println!(
                    "soak run {n}: seed {seed}: {} node(s) x {}, {} scaling, {:?} store, {:?}{}",
                    s.nodes,
                    s.nproc_per_node,
                    s.lr_scaling,
                    s.store,
                    s.network,
                    if in_place { ", in place" } else { "" }
                );
                let dir = out.join(format!("run-{n}-{seed}"));
                let run = match stop.run_until_signal(&rt, harness::run(&s, seed, &tools, &dir)) {
                    Ok(run) => run,
                    Err(signal) => {
                        println!(
                            "soak: {n} runs, stopped during run {n}; logs kept in {}",
                            dir.display()
                        );
                        return interrupted(signal);
                    }
                };
                match run {
                    Ok(r) if r.passed => {
                        let _ = std::fs::remove_dir_all(&dir);
                    }
                    Ok(r) => {
                        print_report(&r, &dir);
                        println!(
                            "soak: invariant violated with seed {seed}; logs kept in {}; replay \
                             with `elastic-chaos run {}/scenario.toml`",
                            dir.display(),
                            dir.display()
                        );
                        return ExitCode::from(1);
                    }
                    Err(e) => {
                        println!(
                            "soak: run with seed {seed} failed: {e:#}; logs kept in {}",
                            dir.display()
                        );
                        return ExitCode::from(1);
                    }
                }
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                n += 1;
            }
            println!("soak: {n} runs, no invariant violated");
            ExitCode::SUCCESS
        }
    }
}
