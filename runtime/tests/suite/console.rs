//! torchrun's console on one node: inherited stdio by default, `--redirects`, `--tee` and
//! `--log-dir` in torchrun's layout, `--local-ranks-filter`, the duplicate filters, the
//! root-cause summary of a failed worker, the launcher's worker variables, and a handled
//! signal that drains.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::util::{agent, python, reader, run, signal, wait_for_line, wait_limit};

const LIMIT: Duration = Duration::from_secs(60);

/// `elastic-run` as a user runs it: none of the suite's tee settings.
fn plain(tmp: &Path) -> Command {
    let mut c = agent(tmp);
    c.env_remove("PET_TEE")
        .env_remove("PET_LOG_DIR")
        .env_remove("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
        .env_remove("TORCH_NCCL_ASYNC_ERROR_HANDLING");
    c
}

/// Each worker writes `out RANK` to stdout and `err RANK` to stderr.
const OUT_AND_ERR: &str = "echo \"out $RANK\"; echo \"err $RANK\" >&2";

fn has_line(text: &str, line: &str) -> bool {
    text.lines().any(|l| l == line)
}

fn mode(p: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}

/// The one run folder under `log_dir`, named `<prefix>_<random>`.
fn run_folder(log_dir: &Path, prefix: &str) -> PathBuf {
    let dirs: Vec<PathBuf> = std::fs::read_dir(log_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    let name = dirs[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with(&format!("{prefix}_")), "{name}");
    dirs[0].clone()
}

#[test]
fn by_default_workers_write_straight_to_the_agents_own_stdout_and_stderr() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = plain(tmp.path());
    // `sh`'s parent is the agent: the same open file on fd 1 means inherited, not piped
    // (`$$`: inside `$(...)` the shell's own fd 1 is the substitution's pipe).
    c.args(["--nproc-per-node", "1", "--"]).args([
        "sh",
        "-c",
        "printf 'p 1\\rp 2\\rdone\\n'; \
         [ \"$(readlink /proc/$$/fd/1)\" = \"$(readlink /proc/$PPID/fd/1)\" ] && echo same-stdout; \
         [ \"$(readlink /proc/$$/fd/2)\" = \"$(readlink /proc/$PPID/fd/2)\" ] && echo same-stderr; \
         echo \"nccl=$TORCH_NCCL_ASYNC_ERROR_HANDLING signals=$TORCHELASTIC_SIGNALS_TO_HANDLE\"; \
         echo \"error_file=$TORCHELASTIC_ERROR_FILE\"; \
         echo 'to stderr' >&2",
    ]);
    let (status, out, err) = run(c, LIMIT);
    assert!(status.success(), "{out}\n{err}");
    let lines: Vec<&str> = out.lines().collect();
    // The worker's exact bytes, progress `\r`s and all, and nothing else.
    assert_eq!(
        lines[..3],
        ["p 1\rp 2\rdone", "same-stdout", "same-stderr"],
        "{out}"
    );
    assert_eq!(
        lines[3], "nccl=1 signals=SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "{out}"
    );
    // No log dir in use: the error file stays in the agent's run dir.
    assert!(lines[4].starts_with("error_file=/") && lines[4].ends_with("/0/error.json"));
    assert!(!lines[4].contains("attempt_"), "{out}");
    assert_eq!(lines.len(), 5, "{out}");
    assert!(has_line(&err, "to stderr"), "{err}");
    assert!(!tmp.path().join("logs").exists());
}

#[test]
fn redirects_3_write_torchruns_layout_privately_and_nothing_to_the_console() {
    let tmp = tempfile::tempdir().unwrap();
    let log_dir = tmp.path().join("logs");
    let mut c = plain(tmp.path());
    c.args([
        "--nproc-per-node",
        "2",
        "--rdzv-id",
        "job7",
        "--redirects",
        "3",
    ])
    .arg("--log-dir")
    .arg(&log_dir)
    .args(["--", "sh", "-c"])
    .arg(format!("{OUT_AND_ERR}; echo \"$TORCHELASTIC_ERROR_FILE\""));
    let (status, out, err) = run(c, LIMIT);
    assert!(status.success(), "{out}\n{err}");
    assert!(!out.contains("out 0") && !out.contains("out 1"), "{out}");
    assert!(!err.contains("err 0") && !err.contains("err 1"), "{err}");
    let folder = run_folder(&log_dir, "job7");
    let attempt = folder.join("attempt_0");
    for rank in 0..2 {
        let d = attempt.join(rank.to_string());
        let stdout = std::fs::read_to_string(d.join("stdout.log")).unwrap();
        assert_eq!(
            stdout,
            format!("out {rank}\n{}\n", d.join("error.json").display())
        );
        assert_eq!(
            std::fs::read_to_string(d.join("stderr.log")).unwrap(),
            format!("err {rank}\n")
        );
        assert_eq!(mode(&d), 0o700);
        assert_eq!(mode(&d.join("stdout.log")), 0o600);
        assert_eq!(mode(&d.join("stderr.log")), 0o600);
    }
    for d in [&folder, &attempt] {
        assert_eq!(mode(d), 0o700, "{}", d.display());
    }
    assert!(!attempt.join("filtered_stdout.log").exists());
}

#[test]
fn a_log_dir_that_is_a_file_or_a_symlink_is_a_usage_error_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    let link = tmp.path().join("a-link");
    std::fs::create_dir(tmp.path().join("elsewhere")).unwrap();
    std::os::unix::fs::symlink(tmp.path().join("elsewhere"), &link).unwrap();
    for (p, what) in [(&file, "is a file"), (&link, "is a symlink")] {
        let mut c = plain(tmp.path());
        c.args(["--tee", "3", "--log-dir"])
            .arg(p)
            .args(["--", "sh", "-c", "echo ran"]);
        let (status, out, err) = run(c, LIMIT);
        assert_eq!(status.code(), Some(2), "{out}\n{err}");
        assert!(
            err.contains("--log-dir")
                && err.contains(&p.display().to_string())
                && err.contains(what),
            "{err}"
        );
        assert!(!out.contains("ran"), "{out}");
    }
    assert_eq!(
        std::fs::read_dir(tmp.path().join("elsewhere"))
            .unwrap()
            .count(),
        0
    );
}

#[test]
fn tee_per_rank_prefixes_teed_streams_and_leaves_the_others_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let log_dir = tmp.path().join("logs");
    let mut c = plain(tmp.path());
    c.args(["--nproc-per-node", "2", "--tee", "0:1,1:2", "--log-dir"])
        .arg(&log_dir)
        .args(["--", "sh", "-c", OUT_AND_ERR]);
    let (status, out, err) = run(c, LIMIT);
    assert!(status.success(), "{out}\n{err}");
    // Rank 0's stdout and rank 1's stderr are teed, with torchrun's `[{role}{local_rank}]:`.
    assert!(has_line(&out, "[default0]:out 0"), "{out}");
    assert!(has_line(&out, "out 1"), "{out}");
    assert!(has_line(&err, "err 0"), "{err}");
    assert!(has_line(&err, "[default1]:err 1"), "{err}");
    let attempt = run_folder(&log_dir, "none").join("attempt_0");
    assert_eq!(
        std::fs::read_to_string(attempt.join("0/stdout.log")).unwrap(),
        "out 0\n"
    );
    assert_eq!(
        std::fs::read_to_string(attempt.join("1/stderr.log")).unwrap(),
        "err 1\n"
    );
    assert!(!attempt.join("0/stderr.log").exists());
    assert!(!attempt.join("1/stdout.log").exists());
}

#[test]
fn local_ranks_filter_and_duplicate_filters_with_a_prefix_template() {
    let tmp = tempfile::tempdir().unwrap();
    let log_dir = tmp.path().join("logs");
    let mut c = plain(tmp.path());
    c.args([
        "--nproc-per-node",
        "2",
        "--tee",
        "3",
        "--local-ranks-filter",
        "0",
        "--duplicate-stdout-filters",
        "keep,also",
        "--duplicate-stderr-filters",
        "bad",
        "--log-dir",
    ])
    .arg(&log_dir)
    .env("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]: ")
    .args([
        "--",
        "sh",
        "-c",
        "echo \"keep $RANK\"; echo \"drop $RANK\"; echo \"bad $RANK\" >&2",
    ]);
    let (status, out, err) = run(c, LIMIT);
    assert!(status.success(), "{out}\n{err}");
    assert!(has_line(&out, "[rank0]: keep 0"), "{out}");
    assert!(has_line(&out, "[rank0]: drop 0"), "{out}");
    assert!(has_line(&err, "[rank0]: bad 0"), "{err}");
    // Rank 1 is filtered out of the console; its teed streams still reach its files.
    assert!(
        !out.contains(" 1") && !err.contains("bad 1"),
        "{out}\n{err}"
    );
    let attempt = run_folder(&log_dir, "none").join("attempt_0");
    assert_eq!(
        std::fs::read_to_string(attempt.join("1/stdout.log")).unwrap(),
        "keep 1\ndrop 1\n"
    );
    assert_eq!(
        std::fs::read_to_string(attempt.join("filtered_stdout.log")).unwrap(),
        "[rank0]: keep 0\n"
    );
    assert_eq!(
        std::fs::read_to_string(attempt.join("filtered_stderr.log")).unwrap(),
        "[rank0]: bad 0\n"
    );

    // Without redirects, a filtered-out rank's streams go nowhere.
    let mut c = plain(tmp.path());
    c.args(["--nproc-per-node", "2", "--local-ranks-filter", "1"])
        .args(["--", "sh", "-c", OUT_AND_ERR]);
    let (status, out, err) = run(c, LIMIT);
    assert!(status.success(), "{out}\n{err}");
    assert!(has_line(&out, "out 1") && !out.contains("out 0"), "{out}");
    assert!(has_line(&err, "err 1") && !err.contains("err 0"), "{err}");
}

/// The text of the summary from its `Root Cause` line on.
fn root_cause(err: &str) -> &str {
    let at = err
        .find("Root Cause (first observed failure):")
        .unwrap_or_else(|| panic!("no summary in:\n{err}"));
    &err[at..]
}

#[test]
fn a_recorded_python_exception_gets_torchruns_root_cause_summary() {
    let tmp = tempfile::tempdir().unwrap();
    let script = tmp.path().join("shard.py");
    std::fs::write(
        &script,
        "from torch.distributed.elastic.multiprocessing.errors import record\n\
         @record\n\
         def main():\n    raise ValueError('bad shard 17')\n\
         main()\n",
    )
    .unwrap();
    let mut c = plain(tmp.path());
    c.args(["--nproc-per-node", "1", "--"])
        .arg(python())
        .arg(&script);
    let (status, out, err) = run(c, Duration::from_secs(120));
    assert_eq!(status.code(), Some(1), "{out}\n{err}");
    // torchrun's title: the script as given.
    assert!(
        err.contains(&format!("\n{} FAILED\n", script.display())),
        "{err}"
    );
    assert!(err.contains("Failures:\n  <NO_OTHER_FAILURES>\n"), "{err}");
    let root = root_cause(&err);
    assert!(root.contains("  rank      : 0 (local_rank: 0)\n"), "{root}");
    assert!(root.contains("  exitcode  : 1 (pid: "), "{root}");
    assert!(root.contains("/0/error.json\n"), "{root}");
    let tb = root.split("  traceback : ").nth(1).unwrap();
    assert!(
        tb.starts_with("Traceback (most recent call last):"),
        "{root}"
    );
    assert!(tb.contains("ValueError: bad shard 17"), "{root}");
    // stderr was the console's: the one-line report says so rather than repeating it.
    assert!(
        err.contains("worker rank 0 (local rank 0) failed with exit code 1"),
        "{err}"
    );
}

#[test]
fn a_sigkilled_worker_is_reported_by_its_signal() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = plain(tmp.path());
    c.args(["--nproc-per-node", "2", "--"]).args([
        "sh",
        "-c",
        "if [ $LOCAL_RANK = 1 ]; then echo \"pid $$\"; kill -9 $$; fi; sleep 30",
    ]);
    let (status, out, err) = run(c, LIMIT);
    assert_eq!(status.code(), Some(137), "{out}\n{err}");
    let pid = out
        .lines()
        .find_map(|l| l.strip_prefix("pid "))
        .unwrap_or_else(|| panic!("{out}"));
    let root = root_cause(&err);
    assert!(root.contains("  rank      : 1 (local_rank: 1)\n"), "{root}");
    assert!(
        root.contains(&format!("  exitcode  : -9 (pid: {pid}) (SIGKILL)\n")),
        "{root}"
    );
    assert!(
        root.contains(&format!(
            "  traceback : Signal 9 (SIGKILL) received by PID {pid}\n"
        )),
        "{root}"
    );
    assert!(root.contains("  error_file: <N/A>\n"), "{root}");
    // Rank 0 was stopped by the agent: it is not a failure of its own.
    assert!(err.contains("Failures:\n  <NO_OTHER_FAILURES>\n"), "{err}");
}

#[test]
fn sigusr1_drains_when_it_is_a_handled_signal() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = plain(tmp.path());
    c.args([
        "--nproc-per-node",
        "1",
        "--signals-to-handle",
        "SIGTERM,SIGUSR1",
        "--",
        "sh",
        "-c",
        // A script that does not speak the agent's protocol: the drain SIGTERMs it at once.
        "trap 'echo \"stopping: $TORCHELASTIC_SIGNALS_TO_HANDLE\"; exit 0' TERM; echo ready; \
         while true; do sleep 0.1; done",
    ]);
    let mut child = c
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = reader(child.stdout.take().unwrap());
    let err = reader(child.stderr.take().unwrap());
    let mut seen = String::new();
    assert!(wait_for_line(&out, "ready", LIMIT, &mut seen), "{seen}");
    signal(&child, libc::SIGUSR1);
    let status = wait_limit(&mut child, LIMIT);
    let (out, err) = (crate::util::collect(out), crate::util::collect(err));
    assert_eq!(status.code(), Some(0), "{seen}{out}\n{err}");
    assert!(has_line(&out, "stopping: SIGTERM,SIGUSR1"), "{out}");
    assert!(err.contains("signal received; draining"), "{err}");
}
