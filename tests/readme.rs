//! Every `elastic-run` command line that README.md shows in a code block, and every example in
//! `elastic-run --help`, runs: the line's own flags, with its placeholders made real. The etcd
//! endpoint becomes a local etcd (a free local port under c10d, which the agents serve), `s3://bucket/...` a bucket in moto, `file:///tmp/...` a
//! temporary directory, the training command `examples/ddp_train.py` for a few steps, and
//! `--nproc-per-node` 1 (each line still says how many); a line with `--nnodes MIN:MAX` runs on MIN agents, as every
//! node runs the same line.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(240);
/// Steps each line's training runs.
const STEPS: &str = "4";

fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

fn bin() -> PathBuf {
    let b = target_dir().join("elastic-run");
    assert!(b.exists(), "build with `cargo test --workspace`");
    b
}

/// The command lines of README.md's indented code blocks that start with `program`, with
/// `\` continuations joined and `# comments` dropped.
fn readme_lines(program: &str) -> Vec<String> {
    let text = std::fs::read_to_string(services::paths::repo_root().join("README.md")).unwrap();
    let mut out = Vec::new();
    let mut current: Option<String> = None;
    for raw in text.lines() {
        let line = raw.trim();
        if let Some(cur) = current.as_mut() {
            cur.push(' ');
            cur.push_str(line.trim_end_matches('\\').trim());
            if !line.ends_with('\\') {
                out.push(current.take().unwrap());
            }
            continue;
        }
        if raw.starts_with("    ") && line.starts_with(&format!("{program} ")) {
            let line = line.split(" # ").next().unwrap().trim();
            if line.ends_with('\\') {
                current = Some(line.trim_end_matches('\\').trim().to_string());
            } else {
                out.push(line.to_string());
            }
        }
    }
    out
}

/// The example lines of `elastic-run --help`.
fn help_lines() -> Vec<String> {
    let out = Command::new(bin()).arg("--help").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    text.lines()
        .map(str::trim)
        .filter(|l| l.starts_with("elastic-run "))
        .map(|l| l.split("   (").next().unwrap().trim().to_string())
        .collect()
}

struct Services {
    etcd: services::Etcd,
    moto: services::Moto,
}

/// Runs `line` (program first) as its README means it; returns each agent's output.
fn run_line(line: &str, svc: &Services, tmp: &Path, n: usize) {
    let repo = services::paths::repo_root();
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(words[0], "elastic-run");
    let mut args: Vec<String> = Vec::new();
    let mut nodes = 1u32;
    let mut i = 1;
    let mut in_command = false;
    let bucket = format!("readme{n}");
    while i < words.len() {
        let w = words[i];
        let value = words.get(i + 1).copied();
        if in_command {
            args.push(match w {
                "train.py" | "examples/ddp_train.py" => {
                    repo.join("examples/ddp_train.py").display().to_string()
                }
                _ => w.to_string(),
            });
            i += 1;
            continue;
        }
        match (w, value) {
            ("--", _) => {
                args.push("--".into());
                in_command = true;
                i += 1;
            }
            // c10d: the agents serve the rendezvous themselves, on a free local port.
            ("--rdzv-endpoint", Some(_)) if line.contains("--rdzv-backend c10d") => {
                let port = std::net::TcpListener::bind(("127.0.0.1", 0))
                    .unwrap()
                    .local_addr()
                    .unwrap()
                    .port();
                args.extend(["--rdzv-endpoint".into(), format!("localhost:{port}")]);
                i += 2;
            }
            ("--rdzv-endpoint", Some(_)) => {
                args.extend(["--rdzv-endpoint".into(), svc.etcd.host_port()]);
                i += 2;
            }
            ("--rdzv-id", Some(id)) => {
                args.extend(["--rdzv-id".into(), format!("{id}-readme{n}")]);
                i += 2;
            }
            ("--nproc-per-node", Some(v)) => {
                let k: u32 = v.parse().unwrap();
                args.extend(["--nproc-per-node".into(), k.min(1).to_string()]);
                i += 2;
            }
            ("--nnodes", Some(v)) => {
                nodes = v.split(':').next().unwrap().parse().unwrap();
                args.extend(["--nnodes".into(), v.to_string()]);
                i += 2;
            }
            ("--checkpoint-url", Some(url)) => {
                let local = if let Some(rest) = url.strip_prefix("s3://") {
                    let path = rest.split_once('/').map_or("", |(_, p)| p);
                    svc.moto.create_bucket(&bucket).unwrap();
                    format!("s3://{bucket}/{path}")
                } else if let Some(path) = url.strip_prefix("file://") {
                    format!(
                        "file://{}",
                        tmp.join(path.trim_start_matches('/')).display()
                    )
                } else {
                    panic!("README line {n}: unexpected --checkpoint-url {url}");
                };
                args.extend(["--checkpoint-url".into(), local]);
                i += 2;
            }
            (script, _) if !script.starts_with('-') && script.ends_with(".py") => {
                // torchrun style: the script and its arguments end the flags.
                in_command = true;
            }
            _ => {
                args.push(w.to_string());
                i += 1;
            }
        }
    }
    // Few steps, whatever the line trains for.
    if let Some(p) = args.iter().position(|a| a == "--steps") {
        args[p + 1] = STEPS.into();
    } else {
        args.extend(["--steps".into(), STEPS.into()]);
    }
    let venv_bin = services::paths::python()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf();
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs = vec![venv_bin];
    dirs.extend(std::env::split_paths(&path));
    let path = std::env::join_paths(dirs).unwrap();
    let children: Vec<_> = (0..nodes)
        .map(|node| {
            let dir = tmp.join(format!("node{node}"));
            std::fs::create_dir_all(&dir).unwrap();
            let mut c = Command::new(bin());
            for (k, _) in std::env::vars_os() {
                let k = k.to_string_lossy().into_owned();
                if k.starts_with("PET_") || k.starts_with("ELASTIC_") {
                    c.env_remove(&k);
                }
            }
            c.args(&args)
                .envs(svc.moto.env())
                .env("PATH", &path)
                .env("ELASTIC_STAGING_DIR", dir.join("staging"))
                .current_dir(&dir)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            c.spawn().unwrap()
        })
        .collect();
    let deadline = Instant::now() + LIMIT;
    for mut child in children {
        loop {
            if child.try_wait().unwrap().is_some() {
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "README/--help line `{line}` as `elastic-run {}` failed: {:?}\nstdout:\n{}\nstderr:\n{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn every_elastic_run_line_of_the_readme_and_help_runs() {
    let _bin = crate::bin_in_use();
    let readme = readme_lines("elastic-run");
    // The README opens with the line a torchrun user writes: an endpoint, elastic --nnodes, no
    // backend. It must be among the lines found, or this test reads nothing.
    assert!(
        readme
            .first()
            .is_some_and(|l| l.starts_with("elastic-run --nnodes 2:8")),
        "{readme:?}"
    );
    let help = help_lines();
    assert!(help.len() >= 2, "{help:?}");
    let svc = Services {
        etcd: services::etcd().unwrap(),
        moto: services::moto().unwrap(),
    };
    for (n, line) in readme.iter().chain(&help).enumerate() {
        let tmp = tempfile::tempdir().unwrap();
        run_line(line, &svc, tmp.path(), n);
    }
}
