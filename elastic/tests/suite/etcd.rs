//! Rendezvous against a real etcd (started by the `services` crate on a free loopback port).
//!
//! The tests run one at a time (they measure timings on a loaded 2-core machine), and their
//! timing bounds are generous: "within TTL + 2 s", never tight numbers. Measured times are
//! printed; run with `--nocapture` to see them.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use elastic::etcd::{Connect, campaign, write_generation};
use elastic::keys::Keys;
use elastic::record::{self, EpochRecord, Generation, RECORD_VERSION, RankedMember};
use elastic::scaling::{OnIndivisible, ScalingConfig, ScalingMode};
use elastic::{Error, Handle, JoinPolicy, Rendezvous, RendezvousConfig, status};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ELASTIC_TEST_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
    SERIAL.lock().await
}

fn scaling() -> ScalingConfig {
    ScalingConfig {
        mode: ScalingMode::Linear,
        per_worker_batch: Some(8),
        base_world_size: 2,
        base_lr: Some(0.1),
        global_batch: None,
        on_indivisible: OnIndivisible::Nearest,
        warmup_steps: None,
    }
}

fn cfg(endpoint: &str, job: &str, node: &str) -> RendezvousConfig {
    let mut c = RendezvousConfig::new(
        [endpoint],
        job,
        node,
        format!("host-{node}"),
        1,
        8,
        scaling(),
    );
    c.lease_ttl_ms = 2_000;
    c.settle_ms = 200;
    c.nproc = 2;
    c
}

/// Waits for the next generation with a bound.
async fn next(h: &mut Handle, within_ms: u64) -> Generation {
    match timeout(Duration::from_millis(within_ms), h.next_generation()).await {
        Ok(Ok(g)) => g,
        Ok(Err(e)) => panic!("{}: next_generation failed: {e}", h.node_id()),
        Err(_) => panic!("{}: no generation within {within_ms} ms", h.node_id()),
    }
}

fn ids(g: &Generation) -> Vec<&str> {
    g.members.iter().map(|m| m.node_id.as_str()).collect()
}

/// Waits until `f` holds for the handle's snapshot.
async fn until(h: &Handle, within_ms: u64, what: &str, f: impl Fn(&elastic::Snapshot) -> bool) {
    let mut rx = h.subscribe();
    let deadline = tokio::time::Instant::now() + Duration::from_millis(within_ms);
    loop {
        if f(&rx.borrow_and_update()) {
            return;
        }
        match tokio::time::timeout_at(deadline, rx.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => panic!("{}: handle closed while waiting for {what}", h.node_id()),
            Err(_) => panic!("{}: {what} not seen within {within_ms} ms", h.node_id()),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_join_and_form_a_generation_with_ranks_and_master() {
    let _g = serial().await;
    let etcd = services::etcd().unwrap();
    let ep = etcd.endpoint();
    let mut hs = Vec::new();
    for n in ["n1", "n2", "n3"] {
        let mut c = cfg(&ep, "join", n);
        c.min_nodes = 2;
        c.max_nodes = 3;
        hs.push(Rendezvous::join(c).await.unwrap());
    }
    let mut gens = Vec::new();
    for h in &mut hs {
        gens.push(next(h, 10_000).await);
    }
    let g = &gens[0];
    assert!(
        gens.iter().all(|x| x == g),
        "every member sees the same generation"
    );
    assert_eq!(g.number, 1);
    assert_eq!(g.world_size, 6);
    assert_eq!(ids(g), ["n1", "n2", "n3"], "rank order is join order");
    assert_eq!(
        g.members.iter().map(|m| m.rank_offset).collect::<Vec<_>>(),
        [0, 2, 4]
    );
    assert_eq!(g.master_addr, "host-n1");
    assert_ne!(g.master_port, 0);
    assert!((g.scaling.lr_scale - 3.0).abs() < 1e-9, "linear 6/2");
    assert_eq!(g.resume_step, None);

    let st = status(&Connect::new([ep.as_str()]), "join").await.unwrap();
    assert_eq!(st.members.len(), 3);
    assert_eq!(st.generation.as_ref(), Some(g));
    assert!(st.leader.is_some());
    assert_eq!(
        st.members
            .iter()
            .find(|m| m.node_id == "n1")
            .unwrap()
            .master_port,
        g.master_port,
        "master port is the one rank 0 published"
    );

    // A duplicate node id is refused while the first holds its key.
    let dup = Rendezvous::join(cfg(&ep, "join", "n2")).await;
    assert!(
        matches!(dup, Err(Error::DuplicateNode { .. })),
        "{:?}",
        dup.err()
    );

    // Graceful leave: revoking the lease is seen by peers in well under a second.
    let leaving = hs.remove(1);
    let t0 = Instant::now();
    leaving.leave().await.unwrap();
    let mut seen = Vec::new();
    for h in &mut hs {
        let g2 = next(h, 5_000).await;
        seen.push(t0.elapsed());
        assert_eq!(ids(&g2), ["n1", "n3"], "survivors keep their order");
        assert_eq!(g2.number, 2);
    }
    let worst = *seen.iter().max().unwrap();
    println!(
        "graceful leave -> new generation at all survivors: {} ms (settle 200 ms)",
        worst.as_millis()
    );
    assert!(
        worst < Duration::from_millis(1_000),
        "graceful leave took {worst:?}"
    );
    for h in hs {
        h.leave().await.unwrap();
    }
    let st = status(&Connect::new([ep.as_str()]), "join").await.unwrap();
    assert!(
        st.members.is_empty() && st.leader.is_none() && st.generation.is_none(),
        "no keys left behind once every member left: {st:?}"
    );
    // But `ctl/epoch`, on its retention lease, which keeps the generation numbers growing.
    let mut client = Connect::new([ep.as_str()]).client(1_000).await.unwrap();
    let left = client
        .get(
            Keys::new("join").prefix(),
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    let left: Vec<&str> = left.kvs().iter().map(|kv| kv.key_str().unwrap()).collect();
    assert_eq!(left, [Keys::new("join").epoch()]);
    assert_eq!(read_epoch(&mut client, "join").await.unwrap().0.number, 2);
}

// ---- member processes for the SIGKILL tests ----

const CHILD_ENV: &str = "ELASTIC_TEST_CHILD";
/// The full name of `child_member_process` in the suite binary, for `--exact`.
const CHILD_TEST: &str = "etcd::child_member_process";

/// Not a test: the entry point of the member *process* the SIGKILL tests spawn (the test
/// binary re-executed with `ELASTIC_TEST_CHILD=endpoint,job,node,ttl_ms`). Without that
/// variable it returns at once.
#[test]
fn child_member_process() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let parts: Vec<&str> = spec.split(',').collect();
    let (ep, job, node, ttl_ms) = (parts[0], parts[1], parts[2], parts[3].parse().unwrap());
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = cfg(ep, job, node);
        c.lease_ttl_ms = ttl_ms;
        let mut h = Rendezvous::join(c).await.unwrap();
        println!("REGISTERED");
        loop {
            let g = h.next_generation().await.unwrap();
            println!("GENERATION {}", g.number);
        }
    });
}

struct ChildMember {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl ChildMember {
    fn spawn(ep: &str, job: &str, node: &str, ttl_ms: u64) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([CHILD_TEST, "--exact", "--nocapture"])
            .env(CHILD_ENV, format!("{ep},{job},{node},{ttl_ms}"))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self { child, lines }
    }

    fn wait_line(&self, prefix: &str, within: Duration) {
        let deadline = Instant::now() + within;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return,
                Ok(_) => {}
                Err(_) => break,
            }
        }
        panic!("member process did not print {prefix} within {within:?}");
    }

    fn sigkill(&mut self) {
        self.child.kill().unwrap(); // SIGKILL
        self.child.wait().unwrap();
    }
}

impl Drop for ChildMember {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_member_process_is_detected_when_its_lease_expires() {
    let _g = serial().await;
    let etcd = services::etcd().unwrap();
    let ep = etcd.endpoint();
    let mut a = Rendezvous::join(cfg(&ep, "kill", "a")).await.unwrap();
    let mut b = Rendezvous::join(cfg(&ep, "kill", "b")).await.unwrap();
    until(&a, 5_000, "a leader", |s| s.leader.is_some()).await;
    let ttl_ms = 1_000;
    let child = {
        let c = ChildMember::spawn(&ep, "kill", "c", ttl_ms);
        c.wait_line("REGISTERED", Duration::from_secs(20));
        c
    };
    let mut child = child;
    // Wait until the generation with all three is formed.
    loop {
        let g = next(&mut a, 10_000).await;
        if g.members.len() == 3 {
            break;
        }
    }
    loop {
        let g = next(&mut b, 10_000).await;
        if g.members.len() == 3 {
            break;
        }
    }
    child.wait_line("GENERATION", Duration::from_secs(10));
    let t0 = Instant::now();
    child.sigkill();
    let g = next(&mut a, ttl_ms + 5_000).await;
    let detected = t0.elapsed();
    assert_eq!(ids(&g), ["a", "b"]);
    let gb = next(&mut b, 2_000).await;
    assert_eq!(gb, g);
    println!(
        "SIGKILL of a member process (TTL {ttl_ms} ms, settle 200 ms) -> new generation: {} ms",
        detected.as_millis()
    );
    assert!(
        detected < Duration::from_millis(ttl_ms + 2_000),
        "detection took {detected:?}"
    );
    a.leave().await.unwrap();
    b.leave().await.unwrap();
}

/// A job of three: "boss", a member process with lease TTL `leader_ttl_ms` that registers
/// first and so leads, then "a" and "b" in this process; returns once a sees the generation
/// of all three.
async fn led_by_a_child(
    ep: &str,
    job: &str,
    leader_ttl_ms: u64,
) -> (ChildMember, Handle, Handle, Generation) {
    let child = ChildMember::spawn(ep, job, "boss", leader_ttl_ms);
    child.wait_line("REGISTERED", Duration::from_secs(20));
    let mut a = Rendezvous::join(cfg(ep, job, "a")).await.unwrap();
    let b = Rendezvous::join(cfg(ep, job, "b")).await.unwrap();
    until(&a, 15_000, "boss leading", |s| {
        s.leader.as_deref() == Some("boss")
    })
    .await;
    let mut g = next(&mut a, 10_000).await;
    while g.members.len() < 3 {
        g = next(&mut a, 10_000).await;
    }
    (child, a, b, g)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_leader_is_replaced_and_survivors_reform() {
    let _g = serial().await;
    let etcd = services::etcd().unwrap();
    let ep = etcd.endpoint();
    let ttl_ms = 1_000;
    let (mut child, mut a, b, g) = led_by_a_child(&ep, "lead", ttl_ms).await;
    assert_eq!(ids(&g)[0], "boss");
    let before = g.number;
    let t0 = Instant::now();
    child.sigkill();
    until(
        &a,
        ttl_ms + 5_000,
        "a new leader",
        |s| matches!(s.leader.as_deref(), Some(l) if l != "boss"),
    )
    .await;
    let takeover = t0.elapsed();
    let g2 = next(&mut a, 5_000).await;
    let reformed = t0.elapsed();
    assert_eq!(ids(&g2), ["a", "b"], "survivors keep their relative order");
    assert_eq!(
        g2.number,
        before + 1,
        "the new leader continued the numbering"
    );
    assert_eq!(g2.master_addr, "host-a");
    println!(
        "leader SIGKILL (TTL {ttl_ms} ms): new leader after {} ms, new generation after {} ms",
        takeover.as_millis(),
        reformed.as_millis()
    );
    assert!(
        takeover < Duration::from_millis(ttl_ms + 2_000),
        "{takeover:?}"
    );
    b.leave().await.unwrap();
    let g3 = next(&mut a, 5_000).await;
    assert_eq!(ids(&g3), ["a"]);
    a.leave().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_that_does_not_confirm_a_regroup_is_deposed_without_waiting_for_its_lease() {
    let _g = serial().await;
    let etcd = services::etcd().unwrap();
    let ep = etcd.endpoint();
    // A lease far longer than the test allows: only the deposition can re-form in time.
    let leader_ttl_ms = 60_000;
    let (mut child, mut a, mut b, g) = led_by_a_child(&ep, "depose", leader_ttl_ms).await;
    child.wait_line(&format!("GENERATION {}", g.number), Duration::from_secs(10));
    child.sigkill();
    // The survivors' workers saw a collective fail: b asks, a confirms, the dead leader cannot.
    let t0 = Instant::now();
    b.request_regroup(g.number, "collective failed")
        .await
        .unwrap();
    let g2 = next(&mut a, 10_000).await;
    let reformed = t0.elapsed();
    assert_eq!(ids(&g2), ["a", "b"], "the silent leader is left out");
    assert!(g2.number > g.number);
    let mut gb = next(&mut b, 5_000).await;
    while gb.number < g2.number {
        gb = next(&mut b, 5_000).await;
    }
    assert_eq!(
        gb.number, g2.number,
        "both survivors are in the new generation"
    );
    let leader = a.subscribe().borrow().leader.clone();
    assert!(
        matches!(leader.as_deref(), Some("a" | "b")),
        "a survivor leads: {leader:?}"
    );
    println!(
        "leader SIGKILL (its TTL {leader_ttl_ms} ms, confirmation window 500 ms): survivors \
         re-formed {} ms after the regroup was asked for",
        reformed.as_millis()
    );
    assert!(reformed < Duration::from_secs(8), "{reformed:?}");
    b.leave().await.unwrap();
    a.leave().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deposed_leader_cannot_write_a_generation() {
    let _g = serial().await;
    let etcd = services::etcd().unwrap();
    let mut client = Connect::new([etcd.endpoint()]).client(1_000).await.unwrap();
    let keys = Keys::new("fence");
    let gen_with = |number: u64, node: &str| Generation {
        version: RECORD_VERSION,
        number,
        members: vec![RankedMember {
            node_id: node.into(),
            addr: "h".into(),
            nproc: 1,
            rank_offset: 0,
            continuing: false,
        }],
        world_size: 1,
        master_addr: "h".into(),
        master_port: 1,
        scaling: scaling().decide(1, None).unwrap(),
        resume_step: None,
        created_unix_ms: 0,
    };
    let old = client.lease_grant(30, None).await.unwrap().id();
    let new = client.lease_grant(30, None).await.unwrap().id();
    assert!(
        campaign(&mut client, &keys, "old", old, 5_000)
            .await
            .unwrap()
    );
    assert!(
        !campaign(&mut client, &keys, "new", new, 5_000)
            .await
            .unwrap(),
        "only one leader at a time"
    );
    let rev1 = write_generation(
        &mut client,
        &keys,
        "old",
        old,
        0,
        &gen_with(1, "old"),
        5_000,
    )
    .await
    .unwrap();
    // A stale previous revision is refused even for the current leader.
    let stale = write_generation(
        &mut client,
        &keys,
        "old",
        old,
        0,
        &gen_with(2, "old"),
        5_000,
    )
    .await;
    assert!(matches!(stale, Err(Error::NotLeader { .. })), "{stale:?}");

    // The old leader's lease ends (it was partitioned, say); a new leader takes over.
    client.lease_revoke(old).await.unwrap();
    assert!(
        campaign(&mut client, &keys, "new", new, 5_000)
            .await
            .unwrap()
    );
    let rev2 = write_generation(
        &mut client,
        &keys,
        "new",
        new,
        0,
        &gen_with(2, "new"),
        5_000,
    )
    .await
    .unwrap();
    assert!(rev2 > rev1);
    // The deposed leader still believes in rev2 (say it saw it); its write fails anyway.
    for prev in [0, rev1, rev2] {
        let r = write_generation(
            &mut client,
            &keys,
            "old",
            old,
            prev,
            &gen_with(3, "old"),
            5_000,
        )
        .await;
        assert!(
            matches!(r, Err(Error::NotLeader { .. })),
            "prev {prev}: {r:?}"
        );
    }
    let st = status(&Connect::new([etcd.endpoint()]), "fence")
        .await
        .unwrap();
    assert_eq!(st.generation.unwrap().members[0].node_id, "new");
    assert_eq!(st.leader.as_deref(), Some("new"));
}

/// An etcd process this test started again; killed (by PID) and reaped on drop.
struct Respawned(Child);

impl Drop for Respawned {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Kills etcd with SIGKILL and starts it again with the very same command line (same ports,
/// same data dir), after `down`. `services::Etcd::restart` is not used: it restarts on the data
/// dir's parent, i.e. on an empty store, which is a different scenario (total data loss).
fn restart_on_same_data(etcd: &mut services::Etcd, down: Duration) -> Respawned {
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", etcd.service.pid())).unwrap();
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    etcd.kill();
    std::thread::sleep(down);
    let mut cmd = Command::new(&args[0]);
    cmd.args(&args[1..]);
    let log = etcd.service.data_dir().unwrap().join("respawned.log");
    let child = Respawned(services::spawn(cmd, &log).unwrap());
    let deadline = Instant::now() + Duration::from_secs(30);
    while !matches!(services::http::get(etcd.service.port(), "/health"), Ok((200, b)) if b.contains("true"))
    {
        assert!(Instant::now() < deadline, "etcd did not come back");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_restart_mid_job_keeps_membership() {
    let _g = serial().await;
    let mut etcd = services::etcd().unwrap();
    let ep = etcd.endpoint();
    let mut hs = Vec::new();
    for n in ["a", "b"] {
        let mut c = cfg(&ep, "restart", n);
        c.lease_ttl_ms = 4_000;
        c.min_nodes = 2;
        hs.push(Rendezvous::join(c).await.unwrap());
    }
    let g1 = next(&mut hs[0], 10_000).await;
    assert_eq!(next(&mut hs[1], 10_000).await, g1);
    let t0 = Instant::now();
    let _respawned = restart_on_same_data(&mut etcd, Duration::from_millis(300));
    println!("etcd down and back in {} ms", t0.elapsed().as_millis());
    // Longer than a TTL after the restart: the leases survived, nobody was fenced.
    tokio::time::sleep(Duration::from_millis(5_000)).await;
    for h in &hs {
        assert!(
            !h.is_fenced(),
            "{} was fenced by a short outage",
            h.node_id()
        );
        assert_eq!(
            h.snapshot().generation.as_deref(),
            Some(&g1),
            "generation unchanged"
        );
    }
    // Membership continues: a new node joins and is admitted.
    let mut c = cfg(&ep, "restart", "c");
    c.lease_ttl_ms = 4_000;
    let mut h3 = Rendezvous::join(c).await.unwrap();
    let g2 = next(&mut hs[0], 10_000).await;
    assert_eq!(ids(&g2), ["a", "b", "c"]);
    assert_eq!(next(&mut h3, 5_000).await, g2);
    for h in hs {
        h.leave().await.unwrap();
    }
    h3.leave().await.unwrap();
}

/// A TCP proxy the test can cut: every open connection is dropped and new ones are refused.
struct Proxy {
    port: u16,
    cut: CancellationToken,
}

impl Proxy {
    async fn start(upstream: std::net::SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = CancellationToken::new();
        let c = cut.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                if c.is_cancelled() {
                    drop(inbound);
                    continue;
                }
                let c = c.clone();
                tokio::spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    tokio::select! {
                        _ = c.cancelled() => {}
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                    }
                });
            }
        });
        Self { port, cut }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn member_that_loses_etcd_fences_itself_before_the_ttl() {
    let _g = serial().await;
    let etcd = services::etcd().unwrap();
    let ep = etcd.endpoint();
    let proxy = Proxy::start(etcd.service.addr()).await;
    let ttl_ms = 2_000;
    let mut a = Rendezvous::join(cfg(&ep, "cut", "a")).await.unwrap();
    until(&a, 5_000, "a leader", |s| s.leader.is_some()).await;
    let mut c = cfg(
        &format!("http://127.0.0.1:{}", proxy.port),
        "cut",
        "cut-off",
    );
    c.lease_ttl_ms = ttl_ms;
    let mut m = Rendezvous::join(c).await.unwrap();
    let mut g = next(&mut a, 10_000).await;
    while g.members.len() < 2 {
        g = next(&mut a, 10_000).await;
    }
    assert_eq!(next(&mut m, 5_000).await, g);

    let t0 = Instant::now();
    proxy.cut.cancel();
    let err = timeout(Duration::from_millis(ttl_ms + 2_000), m.fenced())
        .await
        .expect("fenced signal");
    let fenced_after = t0.elapsed();
    assert!(matches!(err, Error::Fenced { .. }), "{err}");
    // The member's next_generation reports the fence too.
    assert!(matches!(
        m.next_generation().await,
        Err(Error::Fenced { .. })
    ));
    let g2 = next(&mut a, 10_000).await;
    let reformed = t0.elapsed();
    assert_eq!(ids(&g2), ["a"]);
    println!(
        "cut from etcd (TTL {ttl_ms} ms): fenced after {} ms, peers re-formed after {} ms",
        fenced_after.as_millis(),
        reformed.as_millis()
    );
    // The point of fencing: the member knew before its peers acted on the expiry.
    assert!(
        fenced_after < Duration::from_millis(ttl_ms),
        "{fenced_after:?}"
    );
    assert!(fenced_after < reformed);
    a.leave().await.unwrap();
}

/// Forms `[a]` with the given policy and returns the first handle.
async fn one_member_job(ep: &str, job: &str, policy: JoinPolicy) -> Handle {
    let mut c = cfg(ep, job, "a");
    c.join_policy = policy;
    let mut a = Rendezvous::join(c).await.unwrap();
    assert_eq!(ids(&next(&mut a, 10_000).await), ["a"]);
    a
}

async fn joiner(ep: &str, job: &str, node: &str, policy: JoinPolicy) -> Handle {
    let mut c = cfg(ep, job, node);
    c.join_policy = policy;
    Rendezvous::join(c).await.unwrap()
}

/// A step the previous generation's commit pipeline finishes after the next generation was
/// frozen (its resume step named an older commit) re-forms that generation at once with the
/// same members, resuming from the newer step; a commit of the current generation does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_of_the_previous_generation_newer_than_the_resume_step_reforms_the_generation() {
    let _g = serial().await;
    let etcd = services::etcd().unwrap();
    let ep = etcd.endpoint();
    let p = JoinPolicy::Immediate;
    let mut a = one_member_job(&ep, "stale", p).await;
    a.report_commit(5, Some(1)).await.unwrap();
    let mut b = joiner(&ep, "stale", "b", p).await;
    let g2 = next(&mut a, 5_000).await;
    assert_eq!(ids(&g2), ["a", "b"]);
    assert_eq!(g2.resume_step, Some(5));
    assert_eq!(next(&mut b, 5_000).await, g2);

    // Generation 1's pipeline lands step 10 after generation 2 was frozen from step 5.
    a.report_commit(10, Some(g2.number - 1)).await.unwrap();
    let g3 = next(&mut a, 5_000).await;
    assert_eq!(g3.number, g2.number + 1);
    assert_eq!(ids(&g3), ["a", "b"], "the same members, in the same order");
    assert_eq!(g3.resume_step, Some(10));
    assert_eq!(next(&mut b, 5_000).await, g3);

    // A commit of the generation that runs is what it trains: no new generation.
    b.report_commit(15, Some(g3.number)).await.unwrap();
    assert!(
        timeout(Duration::from_millis(1_500), a.next_generation())
            .await
            .is_err(),
        "re-formed for a commit of the current generation"
    );
    a.leave().await.unwrap();
    b.leave().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale_up_waiters_are_admitted_by_each_join_policy() {
    let _g = serial().await;
    let etcd = services::etcd().unwrap();
    let ep = etcd.endpoint();

    // Immediate: admitted after the settle window.
    let p = JoinPolicy::Immediate;
    let mut a = one_member_job(&ep, "imm", p).await;
    let t0 = Instant::now();
    let mut b = joiner(&ep, "imm", "b", p).await;
    let g = next(&mut a, 5_000).await;
    assert_eq!(ids(&g), ["a", "b"]);
    assert_eq!(next(&mut b, 5_000).await, g);
    println!("immediate: admitted after {} ms", t0.elapsed().as_millis());
    // a ran the generation before (it may hold the state in memory); b joins it fresh.
    let continuing: Vec<bool> = g.members.iter().map(|m| m.continuing).collect();
    assert_eq!(continuing, [true, false]);
    assert!(g.continues_besides("b") && !g.continues_besides("a"));
    a.leave().await.unwrap();
    b.leave().await.unwrap();

    // AfterCommit: held back until a commit after the join; the commit is the resume step.
    let p = JoinPolicy::AfterCommit;
    let mut a = one_member_job(&ep, "commit", p).await;
    a.report_commit(5, None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut b = joiner(&ep, "commit", "b", p).await;
    assert!(
        timeout(Duration::from_millis(1_500), a.next_generation())
            .await
            .is_err(),
        "admitted without a commit after joining"
    );
    a.report_commit(4, None).await.unwrap(); // older: ignored
    // What etcd holds, and what a's view (its watch, bounded wait) shows.
    let st = status(&Connect::new([ep.as_str()]), "commit")
        .await
        .unwrap();
    assert_eq!(st.latest_commit.map(|c| c.step), Some(5));
    until(&a, 2_000, "commit 5", |s| {
        s.latest_commit.as_ref().map(|c| c.step) == Some(5)
    })
    .await;
    a.report_commit(10, None).await.unwrap();
    let g = next(&mut a, 5_000).await;
    assert_eq!(ids(&g), ["a", "b"]);
    assert_eq!(g.resume_step, Some(10));
    assert_eq!(next(&mut b, 5_000).await, g);
    a.leave().await.unwrap();
    b.leave().await.unwrap();

    // Waiting(2): one waiter is not enough, two are.
    let p = JoinPolicy::Waiting(2);
    let mut a = one_member_job(&ep, "k", p).await;
    let mut b = joiner(&ep, "k", "b", p).await;
    assert!(
        timeout(Duration::from_millis(1_500), a.next_generation())
            .await
            .is_err(),
        "admitted with one waiter"
    );
    let mut c = joiner(&ep, "k", "c", p).await;
    let g = next(&mut a, 5_000).await;
    assert_eq!(ids(&g), ["a", "b", "c"]);
    assert_eq!(next(&mut b, 5_000).await, g);
    assert_eq!(next(&mut c, 5_000).await, g);
    for h in [a, b, c] {
        h.leave().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_is_seen_at_once_and_the_generation_waits_for_the_leave() {
    let _g = serial().await;
    let etcd = services::etcd().unwrap();
    let ep = etcd.endpoint();
    let mut a = Rendezvous::join(cfg(&ep, "drain", "a")).await.unwrap();
    let b = Rendezvous::join(cfg(&ep, "drain", "b")).await.unwrap();
    let mut g = next(&mut a, 10_000).await;
    while g.members.len() < 2 {
        g = next(&mut a, 10_000).await;
    }
    let t0 = Instant::now();
    b.request_drain().await.unwrap();
    until(&a, 1_000, "b draining", |s| s.draining.contains("b")).await;
    println!("drain seen by a peer after {} ms", t0.elapsed().as_millis());
    // The leader keeps the generation while b saves.
    assert!(
        timeout(Duration::from_millis(800), a.next_generation())
            .await
            .is_err()
    );
    b.leave().await.unwrap();
    let g2 = next(&mut a, 5_000).await;
    assert_eq!(ids(&g2), ["a"]);
    assert!(
        a.snapshot().draining.is_empty(),
        "the drain key went with b's lease"
    );
    a.leave().await.unwrap();
}

/// A member that drained and left is replaced at once, even when it was the leader: every
/// member notes who drains, so the leader elected after it knows the loss was a drain and does
/// not wait out the settle window (20 s here) before re-forming the survivors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_drained_and_left_is_replaced_without_the_settle_window() {
    let _g = serial().await;
    let etcd = services::etcd().unwrap();
    let ep = etcd.endpoint();
    let conf = |node: &str| {
        let mut c = cfg(&ep, "drainedleader", node);
        c.max_nodes = 3;
        c.settle_ms = 20_000;
        c
    };
    let mut hs = Vec::new();
    for n in ["a", "b", "c"] {
        hs.push(Rendezvous::join(conf(n)).await.unwrap());
    }
    // Three of a maximum of three: frozen at once.
    let g1 = next(&mut hs[0], 10_000).await;
    assert_eq!(g1.members.len(), 3);
    until(&hs[0], 2_000, "a leader", |s| s.leader.is_some()).await;
    let leader = hs[0].snapshot().leader.unwrap();
    let i = hs.iter().position(|h| h.node_id() == leader).unwrap();
    let drained = hs.remove(i);
    for h in &mut hs {
        assert_eq!(next(h, 5_000).await, g1);
    }
    drained.request_drain().await.unwrap();
    for h in &hs {
        until(h, 2_000, "the leader draining", |s| {
            s.draining.contains(&leader)
        })
        .await;
    }
    let t0 = Instant::now();
    drained.leave().await.unwrap();
    let g2 = next(&mut hs[0], 10_000).await;
    println!(
        "re-formed {} ms after the drained leader left",
        t0.elapsed().as_millis()
    );
    assert_eq!(g2.members.len(), 2, "{g2:?}");
    assert!(!ids(&g2).contains(&leader.as_str()));
    assert_eq!(next(&mut hs[1], 5_000).await, g2);
    for h in hs {
        h.leave().await.unwrap();
    }
}

/// A commit the leader's agent saw in the store but could not record (etcd was down when it
/// reported it) is recorded with the next generation, which resumes from it: the survivors of
/// a drain during an etcd restart do not redo the steps the drain saved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn next_generation_resumes_from_a_commit_the_leader_saw_but_etcd_missed() {
    let _g = serial().await;
    let etcd = services::etcd().unwrap();
    let ep = etcd.endpoint();
    let a = Rendezvous::join(cfg(&ep, "missedcommit", "a"))
        .await
        .unwrap();
    let b = Rendezvous::join(cfg(&ep, "missedcommit", "b"))
        .await
        .unwrap();
    until(&a, 10_000, "a generation of both", |s| {
        s.generation.as_ref().is_some_and(|g| g.members.len() == 2)
    })
    .await;
    until(&a, 2_000, "a leader", |s| s.leader.is_some()).await;
    let (mut leader, other) = if a.is_leader() { (a, b) } else { (b, a) };
    // a's view was waited on; the leader may be b, whose view is read here: bounded.
    let g1 = next(&mut leader, 5_000).await;
    assert_eq!(g1.members.len(), 2);
    leader.report_commit(30, None).await.unwrap();
    // Both views: the leader's is asserted below, and its watch may deliver the commit after
    // the other member's does.
    for h in [&other, &leader] {
        until(h, 2_000, "commit 30", |s| {
            s.latest_commit.as_ref().map(|c| c.step) == Some(30)
        })
        .await;
    }
    // The drain's step: committed in the store, its report to etcd lost.
    leader.note_commit(36);
    leader.note_commit(33); // an older step seen later changes nothing
    assert_eq!(
        leader.snapshot().latest_commit.map(|c| c.step),
        Some(30),
        "etcd was not told"
    );
    other.request_drain().await.unwrap();
    other.leave().await.unwrap();
    let g2 = next(&mut leader, 5_000).await;
    assert_eq!(ids(&g2), [leader.node_id()]);
    assert_eq!(
        g2.resume_step,
        Some(36),
        "resumes from the commit etcd missed"
    );
    until(&leader, 2_000, "commit 36 recorded", |s| {
        s.latest_commit.as_ref().map(|c| c.step) == Some(36)
    })
    .await;
    // Read back by a fresh reader: the record is in etcd, not only in the leader's view.
    let late = Rendezvous::join(cfg(&ep, "missedcommit", "c"))
        .await
        .unwrap();
    until(&late, 5_000, "commit 36 at a new member", |s| {
        s.latest_commit.as_ref().map(|c| c.step) == Some(36)
    })
    .await;
    late.leave().await.unwrap();
    leader.leave().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_below_min_fails_after_the_timeout_and_finish_is_seen_by_all() {
    let _g = serial().await;
    let etcd = services::etcd().unwrap();
    let ep = etcd.endpoint();
    let mut c = cfg(&ep, "short", "a");
    c.min_nodes = 2;
    c.below_min_timeout_ms = 500;
    let mut a = Rendezvous::join(c).await.unwrap();
    match timeout(Duration::from_secs(5), a.next_generation()).await {
        Ok(Err(Error::JobFailed { reason, .. })) => {
            assert!(reason.contains("below min"), "{reason}")
        }
        other => panic!("expected JobFailed, got {other:?}"),
    }
    a.leave().await.unwrap();
    let st = status(&Connect::new([ep.as_str()]), "short").await.unwrap();
    assert!(st.job_state.is_some());

    let mut a = Rendezvous::join(cfg(&ep, "done", "a")).await.unwrap();
    let mut b = Rendezvous::join(cfg(&ep, "done", "b")).await.unwrap();
    next(&mut a, 10_000).await;
    a.finish(true).await.unwrap();
    // The first outcome stands; a second finish is a no-op.
    b.finish(false).await.unwrap();
    let st = status(&Connect::new([ep.as_str()]), "done").await.unwrap();
    assert_eq!(
        st.job_state.map(|s| s.outcome),
        Some(elastic::record::Outcome::Succeeded)
    );
    for h in [&mut a, &mut b] {
        loop {
            match timeout(Duration::from_secs(5), h.next_generation()).await {
                Ok(Ok(_)) => continue, // b may first see a generation formed before the finish
                Ok(Err(Error::JobFinished { success: true, .. })) => break,
                other => panic!("expected JobFinished, got {other:?}"),
            }
        }
    }
    // A finished job refuses joiners while its agents are still there.
    assert!(matches!(
        Rendezvous::join(cfg(&ep, "done", "late")).await,
        Err(Error::JobFinished { .. })
    ));
    a.leave().await.unwrap();
    b.leave().await.unwrap();
    // Nothing of the job is left but its epoch (the highest generation number) and its
    // outcome, and those hang on retention leases too.
    let mut client = Connect::new([ep.as_str()]).client(1_000).await.unwrap();
    let left = client
        .get(
            "/elastic-run/done/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    let keys: Vec<_> = left
        .kvs()
        .iter()
        .map(|kv| (kv.key_str().unwrap().to_string(), kv.lease()))
        .collect();
    assert_eq!(
        keys.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
        ["/elastic-run/done/ctl/epoch", "/elastic-run/done/ctl/state"],
        "{keys:?}"
    );
    for (key, lease) in keys {
        let ttl = client.lease_time_to_live(lease, None).await.unwrap().ttl();
        assert!(
            ttl > 0 && ttl <= elastic::keys::STATE_RETENTION_S,
            "{key}: lease ttl {ttl}"
        );
    }
}

#[tokio::test]
async fn config_is_checked_before_touching_etcd() {
    let mut c = cfg("http://127.0.0.1:1", "job", "a/b");
    assert!(matches!(
        Rendezvous::join(c.clone()).await,
        Err(Error::InvalidConfig {
            field: "node_id",
            ..
        })
    ));
    c.node_id = "a".into();
    c.lease_ttl_ms = 1_500;
    assert!(matches!(
        Rendezvous::join(c.clone()).await,
        Err(Error::InvalidConfig {
            field: "lease_ttl_ms",
            ..
        })
    ));
    c.lease_ttl_ms = 1_000;
    c.min_nodes = 9;
    assert!(matches!(
        Rendezvous::join(c).await,
        Err(Error::InvalidConfig {
            field: "max_nodes",
            ..
        })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_and_password_auth_is_passed_to_etcd() {
    let _g = serial().await;
    let etcd = services::etcd().unwrap();
    let ep = etcd.endpoint();
    let mut admin = Connect::new([ep.as_str()]).client(1_000).await.unwrap();
    let _ = admin.role_add("root").await;
    admin.user_add("root", "rootpw", None).await.unwrap();
    admin.user_grant_role("root", "root").await.unwrap();
    admin.auth_enable().await.unwrap();

    let with_auth = |node: &str, password: &str| {
        let mut c = cfg(&ep, "auth", node);
        c.connect.auth = Some(elastic::etcd::Auth {
            user: "root".into(),
            password: password.into(),
        });
        c
    };
    // Without credentials, and with a wrong password, etcd refuses.
    assert!(Rendezvous::join(cfg(&ep, "auth", "anon")).await.is_err());
    assert!(Rendezvous::join(with_auth("bad", "wrong")).await.is_err());
    let mut a = Rendezvous::join(with_auth("a", "rootpw")).await.unwrap();
    assert_eq!(ids(&next(&mut a, 10_000).await), ["a"]);
    let mut connect = Connect::new([ep.as_str()]);
    connect.auth = with_auth("x", "rootpw").connect.auth;
    let st = status(&connect, "auth").await.unwrap();
    assert_eq!(st.members.len(), 1);
    a.leave().await.unwrap();
}

/// Runs `openssl` with `args` in `dir`.
fn openssl(dir: &std::path::Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the openssl CLI is needed to make test certificates");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA, and a server and a client certificate it signed, for 127.0.0.1.
fn make_certs(dir: &std::path::Path) {
    let days = ["-days", "2"];
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-subj",
            "/CN=elastic-test-ca",
            days[0],
            days[1],
        ],
    );
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n",
    )
    .unwrap();
    for name in ["server", "client"] {
        let (key, csr, pem) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.pem"),
        );
        openssl(
            dir,
            &[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                &key,
                "-out",
                &csr,
                "-subj",
                &format!("/CN={name}"),
            ],
        );
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &pem,
                "-extfile",
                "ext.cnf",
                days[0],
                days[1],
            ],
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_client_certificates_is_passed_to_etcd() {
    let _g = serial().await;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    make_certs(d);
    let (port, peer) = (
        services::free_port().unwrap(),
        services::free_port().unwrap(),
    );
    let client_url = format!("https://127.0.0.1:{port}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let mut cmd = Command::new(services::paths::etcd().unwrap());
    cmd.args(["--name", "t", "--data-dir"])
        .arg(d.join("data"))
        .args([
            "--listen-client-urls",
            &client_url,
            "--advertise-client-urls",
            &client_url,
        ])
        .args([
            "--listen-peer-urls",
            &peer_url,
            "--initial-advertise-peer-urls",
            &peer_url,
        ])
        .arg(format!("--initial-cluster=t={peer_url}"))
        .args(["--initial-cluster-state", "new", "--log-level", "warn"])
        .args(["--heartbeat-interval", "10", "--election-timeout", "100"])
        .arg("--client-cert-auth")
        .arg(format!("--trusted-ca-file={}", d.join("ca.pem").display()))
        .arg(format!("--cert-file={}", d.join("server.pem").display()))
        .arg(format!("--key-file={}", d.join("server.key").display()));
    let _etcd = Respawned(services::spawn(cmd, &d.join("etcd.log")).unwrap());

    let read = |f: &str| std::fs::read(d.join(f)).unwrap();
    let tls = elastic::etcd::Tls {
        ca_pem: Some(read("ca.pem")),
        client_cert_pem: Some(read("client.pem")),
        client_key_pem: Some(read("client.key")),
        domain: None,
    };
    let mut connect = Connect::new([client_url.as_str()]);
    connect.tls = Some(tls.clone());
    // Wait until the TLS listener answers.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if status(&connect, "tls").await.is_ok() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "etcd with TLS did not come up: {}",
            std::fs::read_to_string(d.join("etcd.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let mut c = cfg(&client_url, "tls", "a");
    c.connect.tls = Some(tls.clone());
    let mut a = Rendezvous::join(c).await.unwrap();
    assert_eq!(ids(&next(&mut a, 10_000).await), ["a"]);

    // Without the client certificate the server refuses the handshake.
    let mut c = cfg(&client_url, "tls", "b");
    c.connect.tls = Some(elastic::etcd::Tls {
        client_cert_pem: None,
        client_key_pem: None,
        ..tls
    });
    c.connect.request_timeout_ms = 2_000;
    assert!(Rendezvous::join(c).await.is_err());
    a.leave().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_outage_longer_than_the_ttl_fences_everyone_and_the_job_recovers() {
    let _g = serial().await;
    let mut etcd = services::etcd().unwrap();
    let ep = etcd.endpoint();
    let ttl_ms = 2_000;
    let mut hs = Vec::new();
    for n in ["a", "b"] {
        let mut c = cfg(&ep, "outage", n);
        c.lease_ttl_ms = ttl_ms;
        hs.push(Rendezvous::join(c).await.unwrap());
    }
    let mut g1 = next(&mut hs[0], 10_000).await;
    while g1.members.len() < 2 {
        g1 = next(&mut hs[0], 10_000).await;
    }
    let t0 = Instant::now();
    // Down for 1.5 TTLs.
    let respawned = tokio::task::spawn_blocking(move || {
        let r = restart_on_same_data(&mut etcd, Duration::from_millis(ttl_ms * 3 / 2));
        (etcd, r)
    });
    for h in &hs {
        let e = timeout(Duration::from_millis(ttl_ms + 2_000), h.fenced())
            .await
            .expect("fenced during the outage");
        assert!(matches!(e, Error::Fenced { .. }));
    }
    let fenced_after = t0.elapsed();
    println!(
        "etcd outage: both members fenced after {} ms (TTL {ttl_ms} ms)",
        fenced_after.as_millis()
    );
    assert!(fenced_after < Duration::from_millis(ttl_ms));
    let (_etcd, _respawned) = respawned.await.unwrap();
    for h in hs {
        h.leave().await.unwrap();
    }
    // Wait until every old key is gone with its lease (etcd renews leases once when it comes
    // back): a total loss, nothing left to carry the generation number over but `ctl/epoch`.
    let deadline = Instant::now() + Duration::from_millis(ttl_ms + 5_000);
    loop {
        let st = status(&Connect::new([ep.as_str()]), "outage")
            .await
            .unwrap();
        if st.members.is_empty() && st.leader.is_none() && st.generation.is_none() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "old keys outlived their leases: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The agents join again with new leases; the job continues with the next generation.
    let mut a = Rendezvous::join(cfg(&ep, "outage", "a")).await.unwrap();
    let mut b = Rendezvous::join(cfg(&ep, "outage", "b")).await.unwrap();
    let mut g2 = next(&mut a, 15_000).await;
    while g2.members.len() < 2 {
        g2 = next(&mut a, 10_000).await;
    }
    // Every member key hung on leases that are gone now; `ctl/epoch` (on its retention lease)
    // kept the highest number, so the numbers keep growing.
    assert_eq!(ids(&g2), ["a", "b"]);
    assert!(g2.created_unix_ms > g1.created_unix_ms);
    assert!(
        g2.number > g1.number,
        "generation {} after a total loss, {} before",
        g2.number,
        g1.number
    );
    println!(
        "total loss: generation {} before, {} after",
        g1.number, g2.number
    );
    assert_eq!(next(&mut b, 5_000).await.number, g2.number);
    a.leave().await.unwrap();
    b.leave().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_cut_from_etcd_fences_itself_and_is_replaced() {
    let _g = serial().await;
    let etcd = services::etcd().unwrap();
    let ep = etcd.endpoint();
    let proxy = Proxy::start(etcd.service.addr()).await;
    let ttl_ms = 2_000;
    let mut lc = cfg(
        &format!("http://127.0.0.1:{}", proxy.port),
        "cutlead",
        "lead",
    );
    lc.lease_ttl_ms = ttl_ms;
    let mut l = Rendezvous::join(lc).await.unwrap();
    until(&l, 5_000, "lead leading", |s| {
        s.leader.as_deref() == Some("lead")
    })
    .await;
    let mut a = Rendezvous::join(cfg(&ep, "cutlead", "a")).await.unwrap();
    let b = Rendezvous::join(cfg(&ep, "cutlead", "b")).await.unwrap();
    let mut g = next(&mut l, 10_000).await;
    while g.members.len() < 3 {
        g = next(&mut l, 10_000).await;
    }
    let t0 = Instant::now();
    proxy.cut.cancel();
    timeout(Duration::from_millis(ttl_ms + 2_000), l.fenced())
        .await
        .expect("the cut leader fences itself");
    let fenced_after = t0.elapsed();
    until(&a, ttl_ms + 5_000, "a new leader", |s| {
        matches!(s.leader.as_deref(), Some("a" | "b"))
    })
    .await;
    let takeover = t0.elapsed();
    let mut g2 = next(&mut a, 5_000).await;
    while g2.members.len() != 2 {
        g2 = next(&mut a, 5_000).await;
    }
    assert_eq!(ids(&g2), ["a", "b"]);
    println!(
        "leader cut from etcd (TTL {ttl_ms} ms): fenced after {} ms, new leader after {} ms",
        fenced_after.as_millis(),
        takeover.as_millis()
    );
    assert!(fenced_after < Duration::from_millis(ttl_ms));
    assert!(
        fenced_after < takeover,
        "the old leader stopped before the new one started"
    );
    a.leave().await.unwrap();
    b.leave().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_generation_below_min_is_announced_until_a_replacement_joins() {
    let _g = serial().await;
    let etcd = services::etcd().unwrap();
    let ep = etcd.endpoint();
    let two = |node: &str| {
        let mut c = cfg(&ep, "below", node);
        c.min_nodes = 2;
        c
    };
    let mut a = Rendezvous::join(two("a")).await.unwrap();
    let mut b = Rendezvous::join(two("b")).await.unwrap();
    let g1 = next(&mut a, 10_000).await;
    assert_eq!(next(&mut b, 5_000).await, g1);
    let t0 = Instant::now();
    b.leave().await.unwrap();
    until(
        &a,
        2_000,
        "the waiting notice",
        |s| matches!(&s.waiting, Some(w) if w.generation == g1.number),
    )
    .await;
    println!(
        "broken generation announced after {} ms",
        t0.elapsed().as_millis()
    );
    let st = status(&Connect::new([ep.as_str()]), "below").await.unwrap();
    assert!(st.waiting.unwrap().reason.contains("below min"));

    let mut c = Rendezvous::join(two("c")).await.unwrap();
    let g2 = next(&mut a, 5_000).await;
    assert_eq!(ids(&g2), ["a", "c"]);
    assert_eq!(next(&mut c, 5_000).await, g2);
    until(&a, 2_000, "the notice cleared", |s| s.waiting.is_none()).await;
    a.leave().await.unwrap();
    c.leave().await.unwrap();
}

// ---- restart requests ----

/// Waits for the next generation on both handles at once; returns each with the time since
/// `t0` at which that handle saw it.
async fn next_on_both(
    a: &mut Handle,
    b: &mut Handle,
    t0: Instant,
    within_ms: u64,
) -> ((Generation, Duration), (Generation, Duration)) {
    tokio::join!(
        async {
            let g = next(a, within_ms).await;
            (g, t0.elapsed())
        },
        async {
            let g = next(b, within_ms).await;
            (g, t0.elapsed())
        }
    )
}

/// Asserts that no new generation appears on `h` within `ms`.
async fn no_new_generation(h: &mut Handle, ms: u64, what: &str) {
    let before = h.snapshot().generation.map(|g| g.number);
    if let Ok(r) = timeout(Duration::from_millis(ms), h.next_generation()).await {
        panic!("{what}: unexpected generation {:?}", r.map(|g| g.number));
    }
    assert_eq!(
        h.snapshot().generation.map(|g| g.number),
        before,
        "{what}: the job's generation moved"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_request_restarts_every_member_in_one_new_generation() {
    let _g = serial().await;
    let etcd = services::etcd().unwrap();
    let ep = etcd.endpoint();
    let two = |node: &str| {
        let mut c = cfg(&ep, "restartreq", node);
        c.min_nodes = 2;
        // A settle window far longer than the measured restart: a restart must not wait for it.
        c.settle_ms = 3_000;
        c
    };
    let mut a = Rendezvous::join(two("a")).await.unwrap();
    let mut b = Rendezvous::join(two("b")).await.unwrap();
    let g1 = next(&mut a, 15_000).await;
    assert_eq!(next(&mut b, 5_000).await, g1);
    assert_eq!(ids(&g1), ["a", "b"]);
    a.report_commit(40, None).await.unwrap();
    // Both views: either member may lead, and the leader's view gives the restart generation
    // its resume step (asserted below).
    for h in [&a, &b] {
        until(h, 2_000, "the commit", |s| {
            s.latest_commit.as_ref().map(|c| c.step) == Some(40)
        })
        .await;
    }

    // b's workers failed in g1: it asks for a restart; every member gets g1 + 1 at once.
    let t0 = Instant::now();
    b.request_restart(g1.number, "worker 1 exited with code 7")
        .await
        .unwrap();
    let ((g2, at_a), (g2b, at_b)) = next_on_both(&mut a, &mut b, t0, 2_000).await;
    assert_eq!(g2, g2b, "both members see the same generation");
    assert_eq!(g2.number, g1.number + 1);
    let ranked = |g: &Generation| -> Vec<(String, u32)> {
        g.members
            .iter()
            .map(|m| (m.node_id.clone(), m.rank_offset))
            .collect()
    };
    assert_eq!(
        ranked(&g2),
        ranked(&g1),
        "same members, same order, same ranks"
    );
    assert!(
        g2.members.iter().all(|m| m.continuing),
        "every member ran g1: {g2:?}"
    );
    assert_eq!(g2.world_size, g1.world_size);
    assert_eq!(g2.resume_step, Some(40), "resumes from the newest commit");
    assert_eq!(g2.master_addr, g1.master_addr);
    assert_ne!(
        g2.master_port, g1.master_port,
        "rank 0's spare port, not the previous generation's TCPStore port"
    );
    let worst = at_a.max(at_b);
    println!(
        "restart request -> new generation at all members: {} ms (a {} ms, b {} ms; settle 3000 ms)",
        worst.as_millis(),
        at_a.as_millis(),
        at_b.as_millis()
    );
    assert!(
        worst < Duration::from_millis(1_500),
        "restart took {worst:?}"
    );

    // Both members fail in g2 and both ask: one new generation, not two.
    let t0 = Instant::now();
    let (ra, rb) = tokio::join!(
        a.request_restart(g2.number, "worker 0 exited with code 1"),
        b.request_restart(g2.number, "worker 1 exited with code 1")
    );
    ra.unwrap();
    rb.unwrap();
    let ((g3, at_a), (g3b, at_b)) = next_on_both(&mut a, &mut b, t0, 2_000).await;
    assert_eq!(g3, g3b);
    assert_eq!(g3.number, g2.number + 1);
    assert_eq!(g3.members, g2.members);
    assert_eq!(
        g3.master_port, g1.master_port,
        "the port alternates between rank 0's two reserved ports"
    );
    println!(
        "two restart requests for one generation -> one new generation after {} ms",
        at_a.max(at_b).as_millis()
    );
    no_new_generation(&mut a, 1_000, "duplicate restart requests").await;

    // Stale requests (generations already restarted) change nothing.
    b.request_restart(g2.number, "late report from the old workers")
        .await
        .unwrap();
    a.request_restart(g1.number, "later still").await.unwrap();
    no_new_generation(&mut b, 1_000, "stale restart requests").await;
    assert_eq!(a.snapshot().generation.as_deref(), Some(&g3));

    // The request of a generation that does not exist is refused before touching etcd.
    assert!(matches!(
        a.request_restart(0, "x").await,
        Err(Error::InvalidConfig { .. })
    ));

    // The requests hang on the requesters' leases: nothing is left once they leave.
    a.leave().await.unwrap();
    b.leave().await.unwrap();
    let mut client = Connect::new([ep.as_str()]).client(1_000).await.unwrap();
    let left = client
        .get(
            Keys::new("restartreq").restart_prefix(),
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    assert!(left.kvs().is_empty(), "restart requests left behind");
}

// ---- generation numbers across a total loss, and the epoch's lease ----

/// The `ctl/epoch` record and the lease it hangs on.
async fn read_epoch(client: &mut etcd_client::Client, job: &str) -> Option<(EpochRecord, i64)> {
    let key = Keys::new(job).epoch();
    let resp = client.get(key.clone(), None).await.unwrap();
    let kv = resp.kvs().first()?;
    Some((record::parse(&key, kv.value()).unwrap(), kv.lease()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn epoch_moves_to_fresh_retention_leases_without_piling_them_up() {
    let _g = serial().await;
    let etcd = services::etcd().unwrap();
    let ep = etcd.endpoint();
    let mut c = cfg(&ep, "epoch", "a");
    c.epoch_refresh_ms = 1_000;
    let mut a = Rendezvous::join(c).await.unwrap();
    let g1 = next(&mut a, 10_000).await;
    let mut client = Connect::new([ep.as_str()]).client(1_000).await.unwrap();
    let (e1, lease1) = read_epoch(&mut client, "epoch").await.expect("ctl/epoch");
    assert_eq!(e1.number, g1.number, "written with the generation");
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    let (e2, lease2) = read_epoch(&mut client, "epoch").await.expect("ctl/epoch");
    assert_eq!(e2.number, g1.number);
    assert_ne!(lease2, lease1, "moved to a fresh lease");
    let old = client.lease_time_to_live(lease1, None).await.unwrap();
    assert_eq!(old.ttl(), -1, "the old lease was revoked");
    let new = client.lease_time_to_live(lease2, None).await.unwrap();
    assert!(
        new.ttl() > elastic::keys::STATE_RETENTION_S - 60,
        "retention lease ttl {}",
        new.ttl()
    );
    // The member's lease, the epoch's, and at most one just granted for the next move.
    let leases = client.leases().await.unwrap();
    assert!(
        leases.leases().len() <= 3,
        "{} leases after 3 refreshes",
        leases.leases().len()
    );
    a.leave().await.unwrap();
}

// ---- compaction ----

/// A TCP proxy the test can pause: while paused it moves no bytes either way (connections stay
/// open), so etcd's sends to the watcher behind it back up, as to a stalled client.
struct PausableProxy {
    port: u16,
    paused: tokio::sync::watch::Sender<bool>,
}

impl PausableProxy {
    async fn start(upstream: std::net::SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (paused, rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let Ok(outbound) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let (ri, wi) = inbound.into_split();
                let (ro, wo) = outbound.into_split();
                tokio::spawn(Self::pipe(ri, wo, rx.clone()));
                tokio::spawn(Self::pipe(ro, wi, rx.clone()));
            }
        });
        Self { port, paused }
    }

    async fn pipe(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        mut paused: tokio::sync::watch::Receiver<bool>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            while *paused.borrow_and_update() {
                if paused.changed().await.is_err() {
                    return;
                }
            }
            tokio::select! {
                n = from.read(&mut buf) => match n {
                    Ok(0) | Err(_) => return,
                    Ok(n) => if to.write_all(&buf[..n]).await.is_err() { return },
                },
                _ = paused.changed() => {}
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_behind_a_compaction_re_reads_and_keeps_following_generations() {
    let _g = serial().await;
    let etcd = services::etcd().unwrap();
    let ep = etcd.endpoint();
    let proxy = PausableProxy::start(etcd.service.addr()).await;
    let job = "compact";
    // The leader talks to etcd directly; the follower `f` through the proxy, with a TTL long
    // enough that the pause below does not fence it.
    let mut a = Rendezvous::join(cfg(&ep, job, "a")).await.unwrap();
    until(&a, 5_000, "a leading", |s| s.leader.as_deref() == Some("a")).await;
    let mut fc = cfg(&format!("http://127.0.0.1:{}", proxy.port), job, "f");
    fc.lease_ttl_ms = 30_000;
    let mut f = Rendezvous::join(fc).await.unwrap();
    let mut g = next(&mut f, 10_000).await;
    while g.members.len() < 2 {
        g = next(&mut f, 10_000).await;
    }
    let g1 = g;

    // Stall f's connection, and write more under ctl/ than the HTTP/2 windows and socket
    // buffers hold (some MB) plus etcd's per-stream queue (128 responses): f's watcher falls
    // behind (a "slow watcher" in etcd's terms), and etcd stops sending it events.
    proxy.paused.send_replace(true);
    let t0 = Instant::now();
    let writer = Connect::new([ep.as_str()]).client(1_000).await.unwrap();
    let noise = vec![b'x'; 64 * 1024];
    futures::future::join_all((0..8).map(|w| {
        let mut c = writer.clone();
        let noise = noise.clone();
        async move {
            for _ in 0..60 {
                let key = format!("/elastic-run/{job}/ctl/noise/{w}");
                c.put(key, noise.clone(), None).await.unwrap();
            }
        }
    }))
    .await;
    // Meanwhile the job moves on: c joins, and the leader freezes a generation f misses.
    let mut c = Rendezvous::join(cfg(&ep, job, "c")).await.unwrap();
    let mut g2 = next(&mut a, 5_000).await;
    while g2.members.len() < 3 {
        g2 = next(&mut a, 5_000).await;
    }
    assert_eq!(next(&mut c, 5_000).await, g2);
    // Compact away every revision f has not seen.
    let mut admin = writer.clone();
    let rev = admin
        .get(Keys::new(job).prefix(), None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    admin
        .compact(
            rev,
            Some(etcd_client::CompactionOptions::new().with_physical()),
        )
        .await
        .unwrap();
    let paused_for = t0.elapsed();
    proxy.paused.send_replace(false);

    // f's watch gets the compaction notice; it re-reads and sees the generation it missed.
    let t1 = Instant::now();
    let seen = next(&mut f, 10_000).await;
    println!(
        "watch behind a compaction: f stalled {} ms, saw the missed generation {} ms after resuming ({} compacted watch(es))",
        paused_for.as_millis(),
        t1.elapsed().as_millis(),
        f.watch_compactions_total()
    );
    assert_eq!(seen, g2);
    assert!(
        f.watch_compactions_total() >= 1,
        "f never hit the compacted revision, so this test proved nothing"
    );
    assert!(!f.is_fenced());

    // And it keeps following: c leaves, f sees the next generation through its new watch.
    c.leave().await.unwrap();
    let g3 = next(&mut f, 5_000).await;
    assert_eq!(ids(&g3), ["a", "f"]);
    assert!(g3.number > g2.number && g2.number > g1.number);
    a.leave().await.unwrap();
    f.leave().await.unwrap();
}

/// `record_commit` never waits on etcd: with this member's connection stalled it returns at
/// once, steps given meanwhile fold into one report, and the newest is in `ctl/commit` once
/// the connection moves again. (An agent's loop calls it; awaiting a report there held the
/// next checkpoint, signals and the fence behind an unreachable etcd.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_commit_returns_at_once_while_etcd_is_stalled_and_records_the_newest_later() {
    let _g = serial().await;
    let etcd = services::etcd().unwrap();
    let ep = etcd.endpoint();
    let proxy = PausableProxy::start(etcd.service.addr()).await;
    let job = "record-soon";
    let mut c = cfg(&format!("http://127.0.0.1:{}", proxy.port), job, "a");
    // Long enough that the stall below does not fence it.
    c.lease_ttl_ms = 30_000;
    let mut a = Rendezvous::join(c).await.unwrap();
    let _ = next(&mut a, 10_000).await;
    a.record_commit(5, None);
    let read = || async {
        status(&Connect::new([ep.as_str()]), job)
            .await
            .unwrap()
            .latest_commit
            .map(|c| c.step)
    };
    let t = Instant::now();
    while read().await != Some(5) {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "step 5 never recorded"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    proxy.paused.send_replace(true);
    let t0 = Instant::now();
    for step in [10, 15, 20] {
        a.record_commit(step, None);
    }
    assert!(
        t0.elapsed() < Duration::from_millis(100),
        "record_commit waited {} ms on a stalled etcd",
        t0.elapsed().as_millis()
    );
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(
        read().await,
        Some(5),
        "recorded through a stalled connection?"
    );

    proxy.paused.send_replace(false);
    let t = Instant::now();
    while read().await != Some(20) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "step 20 not recorded after the stall: {:?}",
            read().await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    a.leave().await.unwrap();
}
