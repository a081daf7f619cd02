//! Rendezvous at scale: N simulated members (tasks in this process, each with its own lease)
//! against one real etcd. Measures the time from the last join to a frozen generation seen by
//! every member, and etcd's steady-state request load (from its Prometheus metrics, counting
//! every gRPC message it received, stream messages such as lease keep-alives included).
//!
//!     cargo run --release -p elastic --example scale -- [members=1000] [clients=members] \
//!         [lease_ttl_ms=10000] [window_s=10]
//!
//! `clients` is the number of etcd connections the members share (one each by default, as
//! separate machines would have).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use elastic::etcd::Connect;
use elastic::scaling::{OnIndivisible, ScalingConfig, ScalingMode};
use elastic::{Handle, Rendezvous, RendezvousConfig};
use tokio::sync::Semaphore;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Joins in flight at once; bounds the burst on etcd and on this process.
const JOINS_IN_FLIGHT_MAX: usize = 128;
/// How long the whole rendezvous may take before the run is declared failed.
const RENDEZVOUS_TIMEOUT_S: u64 = 300;

fn arg(i: usize, default: u64) -> u64 {
    std::env::args()
        .nth(i)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

/// Sum of etcd's received gRPC messages, per method.
fn etcd_messages(port: u16) -> Result<BTreeMap<String, f64>, BoxError> {
    let (status, body) = services::http::get(port, "/metrics").map_err(|e| e.to_string())?;
    if status != 200 {
        return Err(format!("etcd /metrics answered {status}").into());
    }
    let mut by_method = BTreeMap::new();
    for line in body.lines() {
        let Some(rest) = line.strip_prefix("grpc_server_msg_received_total{") else {
            continue;
        };
        let method = rest
            .split("grpc_method=\"")
            .nth(1)
            .and_then(|s| s.split('"').next())
            .unwrap_or("?")
            .to_string();
        let value: f64 = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        *by_method.entry(method).or_insert(0.0) += value;
    }
    Ok(by_method)
}

fn rate(
    a: &BTreeMap<String, f64>,
    b: &BTreeMap<String, f64>,
    secs: f64,
) -> (f64, BTreeMap<String, f64>) {
    let mut per = BTreeMap::new();
    let mut total = 0.0;
    for (m, v) in b {
        let d = (v - a.get(m).copied().unwrap_or(0.0)) / secs;
        if d > 0.0 {
            per.insert(m.clone(), d);
            total += d;
        }
    }
    (total, per)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let members = arg(1, 1000) as usize;
    let clients_n = (arg(2, members as u64) as usize).clamp(1, members);
    let ttl_ms = arg(3, 10_000);
    let window_s = arg(4, 10);

    let etcd = services::etcd().map_err(|e| e.to_string())?;
    let ep = etcd.endpoint();
    let connect = Connect::new([ep.as_str()]);
    let mut clients = Vec::with_capacity(clients_n);
    for _ in 0..clients_n {
        clients.push(connect.client(ttl_ms / 3).await?);
    }
    let scaling = ScalingConfig {
        mode: ScalingMode::Linear,
        per_worker_batch: Some(32),
        base_world_size: members as u64 * 8,
        base_lr: Some(0.1),
        global_batch: None,
        on_indivisible: OnIndivisible::Nearest,
        warmup_steps: None,
    };

    let gate = Arc::new(Semaphore::new(JOINS_IN_FLIGHT_MAX));
    let (seen_tx, mut seen_rx) = tokio::sync::mpsc::channel::<(Instant, u64)>(members);
    let (handle_tx, mut handle_rx) = tokio::sync::mpsc::channel::<(Instant, Handle)>(members);
    let t_start = Instant::now();
    for i in 0..members {
        let mut cfg = RendezvousConfig::new(
            [ep.as_str()],
            "scale",
            format!("m{i:05}"),
            format!("10.0.{}.{}", i / 250, i % 250),
            members as u32,
            members as u32,
            scaling.clone(),
        );
        cfg.nproc = 8;
        cfg.lease_ttl_ms = ttl_ms;
        let client = clients[i % clients_n].clone();
        let gate = gate.clone();
        let (seen_tx, handle_tx) = (seen_tx.clone(), handle_tx.clone());
        tokio::spawn(async move {
            let permit = gate.acquire_owned().await.expect("semaphore open");
            let mut h = match Rendezvous::join_with_client(cfg, client).await {
                Ok(h) => h,
                Err(e) => {
                    eprintln!("join failed: {e}");
                    return;
                }
            };
            drop(permit);
            let joined = Instant::now();
            match h.next_generation().await {
                Ok(g) => {
                    let _ = seen_tx.send((Instant::now(), g.number)).await;
                }
                Err(e) => eprintln!("{}: {e}", h.node_id()),
            }
            let _ = handle_tx.send((joined, h)).await;
        });
    }
    drop((seen_tx, handle_tx));

    let mut seen = Vec::with_capacity(members);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(RENDEZVOUS_TIMEOUT_S);
    while seen.len() < members {
        match tokio::time::timeout_at(deadline, seen_rx.recv()).await {
            Ok(Some(s)) => seen.push(s),
            Ok(None) => break,
            Err(_) => break,
        }
    }
    if seen.len() < members {
        return Err(format!(
            "only {} of {members} members saw a generation within {RENDEZVOUS_TIMEOUT_S} s",
            seen.len()
        )
        .into());
    }
    let mut handles = Vec::with_capacity(members);
    while let Some(h) = handle_rx.recv().await {
        handles.push(h);
    }
    let last_join = handles.iter().map(|(t, _)| *t).max().expect("members > 0");
    let all_seen = seen.iter().map(|(t, _)| *t).max().expect("members > 0");
    let first_seen = seen.iter().map(|(t, _)| *t).min().expect("members > 0");
    let generations: std::collections::BTreeSet<u64> = seen.iter().map(|(_, n)| *n).collect();
    let snapshot = handles[0].1.snapshot();
    let world = snapshot.generation.as_ref().map_or(0, |g| g.world_size);

    // Steady state: let the join burst settle, then two windows back to back.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let m0 = etcd_messages(etcd.service.port())?;
    tokio::time::sleep(Duration::from_secs(window_s)).await;
    let m1 = etcd_messages(etcd.service.port())?;
    tokio::time::sleep(Duration::from_secs(window_s)).await;
    let m2 = etcd_messages(etcd.service.port())?;
    let (r1, per1) = rate(&m0, &m1, window_s as f64);
    let (r2, _) = rate(&m1, &m2, window_s as f64);
    let fenced = handles.iter().filter(|(_, h)| h.is_fenced()).count();

    println!("| metric | value |");
    println!("|---|---|");
    println!("| members (tasks, own leases) | {members} |");
    println!("| etcd connections | {clients_n} |");
    println!("| lease TTL | {ttl_ms} ms |");
    println!(
        "| join phase (start to last join) | {} ms |",
        (last_join - t_start).as_millis()
    );
    println!(
        "| last join -> frozen generation seen by all | {} ms |",
        all_seen.saturating_duration_since(last_join).as_millis()
    );
    println!(
        "| first to last member seeing it | {} ms |",
        (all_seen - first_seen).as_millis()
    );
    println!("| generations seen | {generations:?} (world size {world}) |");
    println!("| steady-state etcd messages/s, window 1 ({window_s} s) | {r1:.1} |");
    println!("| steady-state etcd messages/s, window 2 ({window_s} s) | {r2:.1} |");
    for (m, r) in &per1 {
        println!("| - {m} | {r:.1}/s |");
    }
    println!("| members fenced during the run | {fenced} |");

    let t_leave = Instant::now();
    let mut leaves = tokio::task::JoinSet::new();
    for (_, h) in handles {
        leaves.spawn(async move { h.leave().await });
    }
    while let Some(r) = leaves.join_next().await {
        r??;
    }
    println!(
        "| all {members} members left (lease revokes) | {} ms |",
        t_leave.elapsed().as_millis()
    );
    Ok(())
}
