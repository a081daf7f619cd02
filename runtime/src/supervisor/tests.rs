use super::*;

struct Fixture {
    dir: tempfile::TempDir,
    state: Arc<AgentState>,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let state = Arc::new(AgentState::new(dir.path().to_path_buf()));
    Fixture { dir, state }
}

fn spec(f: &Fixture, nproc: u32, max_restarts: u32) -> WorkerSpec {
    WorkerSpec {
        nproc,
        role: "default".into(),
        run_id: "t".into(),
        node_id: "n".into(),
        max_restarts,
        checkpoint_interval: 0,
        staging_dir: f.dir.path().join("staging"),
        agent_socket: f.dir.path().join("sock"),
        run_dir: f.dir.path().join("run"),
    }
}

fn view(world: u32) -> GenerationView {
    GenerationView {
        generation: 0,
        world_size: world,
        node_rank: 0,
        node_count: 1,
        rank_offset: 0,
        master_addr: "127.0.0.1".into(),
        master_port: 1,
        scaling: elastic::ScalingDecision::identity(),
        resume: None,
        heal_step: None,
    }
}

fn inherit() -> Arc<Launcher> {
    Arc::new(Launcher::inherit("default"))
}

/// stderr teed through the agent into `DIR/logs`.
fn teed(f: &Fixture) -> Arc<Launcher> {
    let logs = Logs::new(crate::logs::LogsConfig {
        tee: crate::cli::StdSpec::All(crate::cli::Std::ERR),
        role: "default".into(),
        run_id: "t".into(),
        log_dir: Some(f.dir.path().join("logs")),
        ..Default::default()
    })
    .unwrap();
    Arc::new(Launcher {
        logs,
        env: LauncherEnv::default(),
    })
}

fn cfg(script: &str) -> SupervisorConfig {
    SupervisorConfig {
        argv: vec!["sh".into(), "-c".into(), script.into()],
        monitor_interval: Duration::from_millis(20),
        hang_timeout: None,
        startup_timeout: Duration::from_millis(300),
        stop_grace: Duration::from_secs(2),
        omp_num_threads_set: false,
        standbys: None,
    }
}

#[tokio::test]
async fn group_of_successful_workers_succeeds() {
    let f = fixture();
    let (_tx, rx) = mpsc::channel(4);
    let out = run(
        cfg("exit 0"),
        spec(&f, 3, 0),
        view(3),
        0,
        inherit(),
        f.state.clone(),
        rx,
    )
    .await;
    assert_eq!(out, Outcome::Succeeded);
}

#[tokio::test]
async fn a_failing_worker_ends_the_group_with_its_code_stderr_and_restart_count() {
    let f = fixture();
    let marker = f.dir.path().join("attempts");
    // Rank 1 fails at once and records the restart count it was given; rank 0 sleeps.
    let script = format!(
        "if [ \"$LOCAL_RANK\" = 1 ]; then echo \"$TORCHELASTIC_RESTART_COUNT\" >> {m}; echo \"bad thing on $RANK\" >&2; exit 7; fi; sleep 30",
        m = marker.display()
    );
    let (_tx, rx) = mpsc::channel(4);
    let t0 = Instant::now();
    let out = run(
        cfg(&script),
        spec(&f, 2, 2),
        view(2),
        2,
        teed(&f),
        f.state.clone(),
        rx,
    )
    .await;
    let Outcome::Failed(fail) = out else {
        panic!("{out:?}")
    };
    assert_eq!((fail.rank, fail.exit_code, fail.restarts), (1, 7, 2));
    assert!(fail.message.contains("bad thing on 1"), "{}", fail.message);
    assert!(fail.pid.is_some() && fail.signal.is_none() && fail.error_file.is_none());
    // Rank 0 was stopped by the agent: not one of the failures.
    assert!(fail.others.is_empty(), "{:?}", fail.others);
    // One group only: restarting is the agent's decision.
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "2\n");
    // The sleeping rank 0 was stopped rather than waited for.
    assert!(t0.elapsed() < Duration::from_secs(20));
}

#[tokio::test]
async fn error_file_beats_stderr_in_the_failure_report() {
    let f = fixture();
    let script = r#"echo noise >&2; printf '{"message":{"message":"RuntimeError: from file","extraInfo":{"py_callstack":"","timestamp":"0"}}}' > "$TORCHELASTIC_ERROR_FILE"; exit 3"#;
    let (_tx, rx) = mpsc::channel(4);
    let Outcome::Failed(fail) = run(
        cfg(script),
        spec(&f, 1, 0),
        view(1),
        0,
        teed(&f),
        f.state.clone(),
        rx,
    )
    .await
    else {
        panic!()
    };
    assert_eq!(fail.exit_code, 3);
    assert_eq!(fail.message, "RuntimeError: from file");
    assert_eq!(fail.traceback.as_deref(), Some("RuntimeError: from file"));
    assert_eq!(fail.time, SystemTime::UNIX_EPOCH);
    let file = fail.error_file.unwrap();
    assert!(
        file.ends_with("attempt_0/0/error.json"),
        "{}",
        file.display()
    );
}

#[tokio::test]
async fn an_inherited_stderr_is_not_in_the_report_and_a_signal_is() {
    let f = fixture();
    let (_tx, rx) = mpsc::channel(4);
    let Outcome::Failed(fail) = run(
        cfg("exit 4"),
        spec(&f, 1, 0),
        view(1),
        0,
        inherit(),
        f.state.clone(),
        rx,
    )
    .await
    else {
        panic!()
    };
    assert!(fail.message.contains("stderr is above"), "{}", fail.message);
    let (_tx, rx) = mpsc::channel(4);
    let Outcome::Failed(fail) = run(
        cfg("kill -9 $$"),
        spec(&f, 1, 0),
        view(1),
        0,
        inherit(),
        f.state.clone(),
        rx,
    )
    .await
    else {
        panic!()
    };
    assert_eq!((fail.exit_code, fail.signal), (128 + 9, Some(9)));
    let pid = fail.pid.unwrap();
    assert_eq!(
        fail.message,
        format!("Signal 9 (SIGKILL) received by PID {pid}")
    );
}

#[tokio::test]
async fn a_redirected_stderr_goes_to_its_file_and_its_tail_to_the_report() {
    let f = fixture();
    let logs = Logs::new(crate::logs::LogsConfig {
        redirects: crate::cli::StdSpec::All(crate::cli::Std::ALL),
        role: "default".into(),
        run_id: "t".into(),
        log_dir: Some(f.dir.path().join("logs")),
        ..Default::default()
    })
    .unwrap();
    let launcher = Arc::new(Launcher {
        logs,
        env: LauncherEnv::default(),
    });
    let (_tx, rx) = mpsc::channel(4);
    let script = "echo out; echo 'worker said no' >&2; exit 2";
    let Outcome::Failed(fail) = run(
        cfg(script),
        spec(&f, 1, 0),
        view(1),
        0,
        launcher.clone(),
        f.state.clone(),
        rx,
    )
    .await
    else {
        panic!()
    };
    assert_eq!(fail.message, "worker said no");
    let dir = launcher.logs.run_dir().unwrap().join("attempt_0/0");
    assert_eq!(
        std::fs::read_to_string(dir.join("stdout.log")).unwrap(),
        "out\n"
    );
}

#[test]
fn stop_grace_is_the_flag_else_the_variable_else_the_default() {
    let d = Duration::from_secs(5);
    assert_eq!(
        stop_grace(Some(7), Some("9"), d),
        Ok(Duration::from_secs(7))
    );
    assert_eq!(stop_grace(None, Some("9"), d), Ok(Duration::from_secs(9)));
    assert_eq!(stop_grace(None, None, d), Ok(d));
    assert_eq!(stop_grace(None, Some(""), d), Ok(d));
    for bad in ["x", "-1", "1.5", "100000"] {
        let e = stop_grace(None, Some(bad), d).unwrap_err();
        assert!(e.contains(SHUTDOWN_TIMEOUT_ENV), "{e}");
    }
}

#[tokio::test]
async fn silent_group_is_killed_as_hung_and_counts_as_a_failure() {
    let f = fixture();
    let mut c = cfg("sleep 30");
    c.hang_timeout = Some(Duration::from_millis(300));
    let (_tx, rx) = mpsc::channel(4);
    let t0 = Instant::now();
    let Outcome::Failed(fail) = run(
        c,
        spec(&f, 2, 1),
        view(2),
        1,
        inherit(),
        f.state.clone(),
        rx,
    )
    .await
    else {
        panic!()
    };
    assert!(
        fail.message.contains("no worker reported progress"),
        "{}",
        fail.message
    );
    assert_eq!(fail.restarts, 1);
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}

#[tokio::test]
async fn drain_past_its_deadline_stops_workers_that_ignore_sigterm() {
    let f = fixture();
    let (tx, rx) = mpsc::channel(4);
    let mut c = cfg("trap '' TERM; sleep 30 & wait; sleep 30");
    c.stop_grace = Duration::from_millis(200);
    let sup = tokio::spawn(run(
        c,
        spec(&f, 2, 0),
        view(2),
        0,
        inherit(),
        f.state.clone(),
        rx,
    ));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t0 = Instant::now();
    tx.send(Command::Drain {
        deadline: Instant::now() + Duration::from_millis(300),
        sigterm_now: true,
    })
    .await
    .unwrap();
    assert_eq!(sup.await.unwrap(), Outcome::Drained { clean: false });
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

#[tokio::test]
async fn stop_reaps_grandchildren_in_the_worker_group() {
    let f = fixture();
    let pidfile = f.dir.path().join("grandchild");
    let script = format!("sleep 60 & echo $! > {}; wait", pidfile.display());
    let (tx, rx) = mpsc::channel(4);
    let sup = tokio::spawn(run(
        cfg(&script),
        spec(&f, 1, 0),
        view(1),
        0,
        inherit(),
        f.state.clone(),
        rx,
    ));
    let deadline = Instant::now() + Duration::from_secs(5);
    while !pidfile.exists() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let pid: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    tx.send(Command::Stop).await.unwrap();
    assert_eq!(sup.await.unwrap(), Outcome::Stopped);
    // The grandchild was SIGKILLed; as an orphan it is reaped by init (or is a zombie
    // briefly): either way it is no longer running.
    let gone = (0..100).any(|_| {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let running = !stat.is_empty() && !stat.contains(") Z");
        if running {
            std::thread::sleep(Duration::from_millis(20));
        }
        !running
    });
    assert!(gone, "grandchild {pid} survived the stop");
}
