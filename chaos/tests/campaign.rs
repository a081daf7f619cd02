//! The CI campaign: every scenario in `chaos/scenarios/`, with its seed, against real etcd,
//! moto and PyTorch; every invariant must hold. The runs are printed with their seeds.

use std::path::PathBuf;

#[test]
fn campaign_of_seeded_scenarios_keeps_every_invariant() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let tools = chaos::harness::Tools::from_repo().expect("elastic-run and the .venv are built");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut names: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    names.sort();
    assert!(names.len() >= 4, "{names:?}");
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("campaign");
    let mut failed = vec![];
    for path in names {
        let text = std::fs::read_to_string(&path).unwrap();
        let s = chaos::scenario::Scenario::parse(&text, &path.display().to_string()).unwrap();
        let seed = s.seed.unwrap_or(0);
        let dir = out.join(&s.name);
        let tools = tools.for_scenario(&s, false).unwrap();
        let r = rt
            .block_on(chaos::harness::run(&s, seed, &tools, &dir))
            .unwrap_or_else(|e| panic!("{}: {e:#}", s.name));
        eprintln!(
            "scenario {} seed {seed}: passed {} in {} ms",
            s.name, r.passed, r.wall_ms
        );
        for f in &r.faults {
            eprintln!(
                "  {:?} node{}: detected {:?} ms, recovered {:?} ms, lost {:?}",
                f.kind, f.node, f.detection_ms, f.recovery_ms, f.lost_steps
            );
        }
        for c in r.checks.iter().filter(|c| !c.ok) {
            failed.push(format!(
                "{} (seed {seed}): {}: {} [logs {}]",
                s.name,
                c.name,
                c.detail,
                dir.display()
            ));
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// The store fault proxy against real moto, as the agents meet it through the checkpoint
/// crate: 503s and refusals fail a call whose deadline they outlast, slowness delays it, and
/// everything works again once the proxy is back up.
#[test]
fn store_fault_proxy_modes_reach_the_checkpoint_store() {
    use chaos::proxy::{Mode, Proxy};
    use std::time::{Duration, Instant};

    let moto = services::moto().expect("moto starts");
    moto.create_bucket("faults").unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let proxy = Proxy::start(moto.service.addr()).await.unwrap();
        let opts = [
            ("aws_endpoint", format!("http://{}", proxy.addr)),
            ("aws_allow_http", "true".into()),
            ("aws_access_key_id", "testing".into()),
            ("aws_secret_access_key", "testing".into()),
            ("aws_region", "us-east-1".into()),
        ];
        let store = checkpoint::Store::open_with_options("s3://faults/job", opts)
            .unwrap()
            .with_options(checkpoint::StoreOptions {
                deadline_ms: 1_500,
                backoff_initial_ms: 50,
                backoff_max_ms: 200,
                ..Default::default()
            });
        let cancel = checkpoint::CancellationToken::new();
        assert_eq!(
            store.committed_steps(&cancel).await.unwrap(),
            Vec::<u64>::new()
        );

        for mode in [Mode::Http503, Mode::Down] {
            proxy.set_mode(mode);
            let e = store
                .committed_steps(&cancel)
                .await
                .expect_err("the store is faulted");
            eprintln!("{mode:?}: {e}");
            proxy.set_mode(Mode::Up);
            store.committed_steps(&cancel).await.unwrap();
        }

        proxy.set_mode(Mode::Slow { delay_ms: 300 });
        let t = Instant::now();
        store.committed_steps(&cancel).await.unwrap();
        assert!(
            t.elapsed() >= Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
    });
}
