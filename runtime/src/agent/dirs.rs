//! The agent's directories: the private run dir (socket, error files) and the staging dir
//! (`/dev/shm`), made 0700 without following symlinks, and removed only where the agent made
//! them.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// Frees staging space between worker groups: every `step-N` left there was committed or
/// abandoned (the committer is idle when this runs).
pub(super) fn remove_staged(staging: &Path) {
    let Ok(entries) = std::fs::read_dir(staging) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        if name.to_str().is_some_and(|n| n.starts_with("step-")) {
            // A symlink named `step-N`, or another user's dir, is not the agent's to remove.
            remove_own_dir_all(&e.path());
        }
    }
}

/// The staging directory: `--staging-dir`, else `/dev/shm/elastic-run/<run>/<node>` (the
/// temp dir when there is no /dev/shm). Canonical, since `saved` directories are checked
/// against it. /dev/shm is world-writable, so every directory the agent makes there is
/// made without following symlinks, mode 0700, and checked to be a real directory of this
/// user; a symlink or another user's directory on the way is refused. On exit the agent
/// removes only the directories it created: what is left in its node dir was never
/// committed, and /dev/shm is memory. A `--staging-dir` is never removed.
pub(super) struct Staging {
    pub(super) path: PathBuf,
    /// The directories this agent created, outermost first.
    pub(super) created: Vec<PathBuf>,
}

impl Staging {
    pub(super) fn prepare(dir: Option<&Path>, run_id: &str, node_id: &str) -> Result<Self> {
        if let Some(d) = dir {
            return Self::given(d);
        }
        let root = Path::new(crate::cli::STAGING_ROOT_DEFAULT);
        let top = root.file_name().unwrap_or("elastic-run".as_ref());
        let base = match root.parent() {
            Some(shm) if shm.is_dir() => shm.to_path_buf(),
            _ => std::env::temp_dir(),
        };
        let name = |s: &str| match sanitize(s) {
            s if s.is_empty() => "_".to_string(),
            s => s,
        };
        Self::under(&base, [top, name(run_id).as_ref(), name(node_id).as_ref()])
    }

    /// A user-given `--staging-dir`: created 0700 when absent; refused when it is a symlink
    /// or another user's. Symlinks above it are the user's own choice and are resolved.
    fn given(d: &Path) -> Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        match std::fs::symlink_metadata(d) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(d)
                .with_context(|| format!("create staging dir {}", d.display()))?,
            Err(e) => {
                return Err(e).with_context(|| format!("staging dir {}", d.display()));
            }
            Ok(_) => {}
        }
        check_own_dir(d)?;
        let path =
            std::fs::canonicalize(d).with_context(|| format!("staging dir {}", d.display()))?;
        Ok(Staging {
            path,
            created: Vec::new(),
        })
    }

    /// `base/a/b/c`, each part made (0700) or found as a real directory of this user.
    /// `base` is the system's (/dev/shm or the temp dir) and is taken as it resolves.
    fn under(base: &Path, parts: [&std::ffi::OsStr; 3]) -> Result<Self> {
        let base = std::fs::canonicalize(base)
            .with_context(|| format!("staging base {}", base.display()))?;
        // Built as it goes, so that an error drops (and removes) what was made so far.
        let mut s = Staging {
            path: PathBuf::new(),
            created: Vec::new(),
        };
        let mut attempt = 0;
        'again: loop {
            attempt += 1;
            let mut dir = base.clone();
            for part in parts {
                dir.push(part);
                match make_own_dir(&dir) {
                    Ok(true) => s.created.push(dir.clone()),
                    Ok(false) => {}
                    // Another agent removed a parent it had made, between our steps.
                    Err(e)
                        if attempt < 5
                            && e.downcast_ref::<std::io::Error>()
                                .is_some_and(|e| e.kind() == std::io::ErrorKind::NotFound) =>
                    {
                        continue 'again;
                    }
                    Err(e) => return Err(e),
                }
            }
            s.path = dir;
            return Ok(s);
        }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // Innermost first; the node dir goes with its contents, the shared ones above it
        // only once empty (remove_dir refuses non-empty ones, so other agents' dirs are safe).
        for d in self.created.iter().rev() {
            if *d == self.path {
                remove_own_dir_all(d);
            } else if std::fs::remove_dir(d).is_err() {
                break;
            }
        }
    }
}

/// Makes `dir` (mode 0700; its parent must already be checked), or finds it; either way it
/// must then be a real directory of this user. Returns whether it was made here. mkdir does
/// not follow a symlink in the last component, so a planted one is found, not followed.
fn make_own_dir(dir: &Path) -> Result<bool> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let made = match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => false,
        Err(e) => {
            return Err(
                anyhow::Error::new(e).context(format!("create staging dir {}", dir.display()))
            );
        }
    };
    check_own_dir(dir)?;
    if !made {
        // Ours already (an earlier agent of this user): keep it private.
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("chmod staging dir {}", dir.display()))?;
    }
    Ok(made)
}

/// `dir` must be a real directory (not a symlink) owned by this process's effective user.
fn check_own_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let m =
        std::fs::symlink_metadata(dir).with_context(|| format!("staging dir {}", dir.display()))?;
    if m.file_type().is_symlink() {
        let to = std::fs::read_link(dir)
            .map(|t| format!(" (to {})", t.display()))
            .unwrap_or_default();
        bail!(
            "staging dir {} is a symlink{to}: refusing to follow it (another user may have planted it)",
            dir.display()
        );
    }
    if !m.is_dir() {
        bail!("staging dir {} is not a directory", dir.display());
    }
    let me = euid();
    if m.uid() != me {
        bail!(
            "staging dir {} is owned by uid {}, not by this user (uid {me}): refusing to use it",
            dir.display(),
            m.uid()
        );
    }
    Ok(())
}

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Whether `p` is a real directory of this user (not a symlink to one).
fn is_own_real_dir(p: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir() && m.uid() == euid())
}

/// `remove_dir_all`, only when `p` itself is a real directory of this user (std's
/// remove_dir_all does not follow symlinks below it).
fn remove_own_dir_all(p: &Path) {
    if is_own_real_dir(p) {
        let _ = std::fs::remove_dir_all(p);
    }
}

/// Removes `p`, a directory strictly inside `staging`, when every component from `staging`
/// down to it is a real directory of this user: nothing reached through a symlink goes.
pub(super) fn remove_inside_staging(staging: &Path, p: &Path) {
    let Ok(rest) = p.strip_prefix(staging) else {
        return;
    };
    if rest.as_os_str().is_empty()
        || rest
            .components()
            .any(|c| !matches!(c, std::path::Component::Normal(_)))
    {
        return;
    }
    let mut d = staging.to_path_buf();
    for c in rest.components() {
        d.push(c);
        if !is_own_real_dir(&d) {
            return;
        }
    }
    let _ = std::fs::remove_dir_all(p);
}

fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect::<String>()
        .trim_start_matches('.')
        .to_string()
}

/// The agent's private directory (socket, error files), removed when the agent exits.
pub(super) struct RunDir {
    pub(super) path: PathBuf,
}

impl RunDir {
    /// Prefix of run dirs in the temp dir; the PID follows.
    const PREFIX: &'static str = "elastic-run-";

    pub(super) fn create() -> Result<Self> {
        Self::remove_stale();
        use std::os::unix::fs::DirBuilderExt;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        // Short path: a Unix socket path must fit in 108 bytes.
        let path =
            std::env::temp_dir().join(format!("elastic-run-{}-{nanos:x}", std::process::id()));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .with_context(|| format!("create {}", path.display()))?;
        Ok(RunDir { path })
    }

    /// Makes `<run dir>/<name>` (0700) for something the agent runs (the etcd it serves for
    /// `--rdzv-backend c10d` keeps its data there). mkdir does not follow a symlink in the last
    /// component, and one already there is refused: the directory is new and this agent's.
    pub(super) fn private_dir(&self, name: &str) -> Result<PathBuf> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = self.path.join(name);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .with_context(|| format!("create {}", dir.display()))?;
        check_own_dir(&dir)?;
        Ok(dir)
    }
}

impl RunDir {
    /// Removes run dirs of agents that are gone (a SIGKILLed agent cannot clean up after
    /// itself). Dirs of live PIDs are kept, so a reused PID errs on the side of keeping.
    fn remove_stale() {
        Self::remove_stale_in(&std::env::temp_dir());
    }

    /// The temp dir is shared: only real directories (not symlinks) of this user go.
    fn remove_stale_in(tmp: &Path) {
        let Ok(entries) = std::fs::read_dir(tmp) else {
            return;
        };
        for e in entries.flatten().take(10_000) {
            let name = e.file_name();
            let Some(pid) = name
                .to_str()
                .and_then(|n| n.strip_prefix(Self::PREFIX))
                .and_then(|rest| rest.split_once('-'))
                .and_then(|(pid, _)| pid.parse::<u32>().ok())
            else {
                continue;
            };
            let dir = e.path();
            if !Path::new(&format!("/proc/{pid}")).exists()
                && is_own_real_dir(&dir)
                && dir.join("agent.sock").exists()
            {
                remove_own_dir_all(&dir);
            }
        }
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staged_steps_are_removed_between_groups() {
        let tmp = tempfile::tempdir().unwrap();
        for s in ["step-5", "step-10", "step-11", "other"] {
            std::fs::create_dir_all(tmp.path().join(s).join("rank-0")).unwrap();
        }
        remove_staged(tmp.path());
        let mut left: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, ["other"]);
    }

    #[test]
    fn node_ids_become_safe_path_parts() {
        assert_eq!(sanitize("../a/b c"), "_a_b_c");
        assert_eq!(sanitize("node-1.x"), "node-1.x");
    }

    fn mode(p: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    fn parts<'a>(a: &'a str, b: &'a str, c: &'a str) -> [&'a std::ffi::OsStr; 3] {
        [a.as_ref(), b.as_ref(), c.as_ref()]
    }

    /// A directory holding a sentinel file, standing for one that is not the agent's.
    fn victim(root: &Path) -> PathBuf {
        let v = root.join("victim");
        std::fs::create_dir(&v).unwrap();
        std::fs::write(v.join("sentinel"), "keep me").unwrap();
        v
    }

    fn other_user_dir(p: &Path) {
        std::fs::create_dir_all(p).unwrap();
        std::os::unix::fs::chown(p, Some(65534), Some(65534)).unwrap();
    }

    #[test]
    fn default_staging_dirs_are_made_private_and_removed_on_drop() {
        let tmp = tempfile::tempdir().unwrap();
        let s = Staging::under(tmp.path(), parts("elastic-run", "job", "n0")).unwrap();
        let root = std::fs::canonicalize(tmp.path()).unwrap();
        assert_eq!(s.path, root.join("elastic-run/job/n0"));
        for d in ["elastic-run", "elastic-run/job", "elastic-run/job/n0"] {
            assert_eq!(mode(&root.join(d)), 0o700, "{d}");
        }
        std::fs::create_dir_all(s.path.join("step-3/rank-0")).unwrap();
        drop(s);
        assert!(!root.join("elastic-run").exists());
    }

    #[test]
    fn a_symlink_planted_in_default_staging_is_refused_and_its_target_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let v = victim(tmp.path());
        // At the node dir: the issue as found.
        std::fs::create_dir_all(tmp.path().join("elastic-run/job")).unwrap();
        let node = tmp.path().join("elastic-run/job/n0");
        std::os::unix::fs::symlink(&v, &node).unwrap();
        let r = Staging::under(tmp.path(), parts("elastic-run", "job", "n0"));
        let e = format!("{:#}", r.as_ref().map(|_| ()).unwrap_err());
        drop(r);
        assert!(
            e.contains("symlink") && e.contains("elastic-run/job/n0"),
            "{e}"
        );
        assert!(v.join("sentinel").exists());
        assert!(std::fs::symlink_metadata(&node).unwrap().is_symlink());
        // At the shared root: refused too, and nothing is made through it.
        let tmp2 = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(&v, tmp2.path().join("elastic-run")).unwrap();
        let r = Staging::under(tmp2.path(), parts("elastic-run", "job", "n0"));
        let e = format!("{:#}", r.as_ref().map(|_| ()).unwrap_err());
        drop(r);
        assert!(e.contains("symlink") && e.contains("elastic-run"), "{e}");
        let left: Vec<_> = std::fs::read_dir(&v).unwrap().collect();
        assert_eq!(left.len(), 1, "only the sentinel");
    }

    #[test]
    fn a_default_staging_parent_of_another_user_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        other_user_dir(&tmp.path().join("elastic-run"));
        let e = Staging::under(tmp.path(), parts("elastic-run", "job", "n0"))
            .map(|_| ())
            .unwrap_err();
        let e = format!("{e:#}");
        assert!(
            e.contains("elastic-run") && e.contains("owned by uid 65534"),
            "{e}"
        );
        assert!(!tmp.path().join("elastic-run/job").exists());
    }

    #[test]
    fn staging_dirs_the_agent_did_not_create_are_kept_on_drop() {
        let tmp = tempfile::tempdir().unwrap();
        let node = tmp.path().join("elastic-run/job/n0");
        std::fs::create_dir_all(&node).unwrap();
        std::fs::write(node.join("mine"), "x").unwrap();
        let s = Staging::under(tmp.path(), parts("elastic-run", "job", "n0")).unwrap();
        // Found, not made: ours, so kept private.
        assert_eq!(mode(&node), 0o700);
        drop(s);
        assert!(node.join("mine").exists());
        // Only the node dir made here goes; the parents found here stay.
        let s = Staging::under(tmp.path(), parts("elastic-run", "job", "n1")).unwrap();
        drop(s);
        assert!(!tmp.path().join("elastic-run/job/n1").exists());
        assert!(node.join("mine").exists());
    }

    #[test]
    fn a_given_staging_dir_must_be_a_real_dir_of_this_user() {
        let tmp = tempfile::tempdir().unwrap();
        let v = victim(tmp.path());
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&v, &link).unwrap();
        let e = format!("{:#}", Staging::given(&link).map(|_| ()).unwrap_err());
        assert!(e.contains("symlink") && e.contains("link"), "{e}");
        let theirs = tmp.path().join("theirs");
        other_user_dir(&theirs);
        let e = format!("{:#}", Staging::given(&theirs).map(|_| ()).unwrap_err());
        assert!(e.contains("owned by uid 65534"), "{e}");
        let fresh = tmp.path().join("a/fresh");
        let s = Staging::given(&fresh).unwrap();
        assert_eq!(mode(&fresh), 0o700);
        drop(s);
        assert!(fresh.is_dir(), "a --staging-dir is never removed");
        assert!(v.join("sentinel").exists());
    }

    #[test]
    fn staged_copies_are_removed_only_as_real_dirs_of_this_user() {
        let tmp = tempfile::tempdir().unwrap();
        let staging = tmp.path().join("staging");
        std::fs::create_dir(&staging).unwrap();
        let v = victim(tmp.path());
        std::fs::create_dir(v.join("step-9")).unwrap();
        std::os::unix::fs::symlink(&v, staging.join("step-8")).unwrap();
        std::os::unix::fs::symlink(&v, staging.join("via")).unwrap();
        std::fs::create_dir_all(staging.join("step-7/rank-0")).unwrap();
        other_user_dir(&staging.join("step-7"));
        std::fs::create_dir_all(staging.join("step-6/rank-0")).unwrap();
        // The committer's removal of a step dir: not through a symlink, not a symlink.
        remove_inside_staging(&staging, &staging.join("via/step-9"));
        assert!(v.join("step-9").is_dir());
        remove_inside_staging(&staging, &staging.join("step-8"));
        remove_inside_staging(&staging, &staging);
        remove_inside_staging(&staging, &staging.join("../staging/step-6"));
        assert!(staging.join("step-6").is_dir());
        assert!(std::fs::symlink_metadata(staging.join("step-8")).is_ok());
        remove_inside_staging(&staging, &staging.join("step-6"));
        assert!(!staging.join("step-6").exists());
        // Between groups.
        remove_staged(&staging);
        assert!(std::fs::symlink_metadata(staging.join("step-8")).is_ok());
        assert!(staging.join("step-7/rank-0").is_dir());
        assert!(v.join("sentinel").exists() && v.join("step-9").is_dir());
    }

    #[test]
    fn private_dirs_in_the_run_dir_are_new_and_never_through_a_symlink() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunDir {
            path: tmp.path().join("run"),
        };
        std::fs::create_dir(&run.path).unwrap();
        let d = run.private_dir("rdzv").unwrap();
        assert_eq!(mode(&d), 0o700);
        assert!(run.private_dir("rdzv").is_err(), "not one found there");
        let v = victim(tmp.path());
        std::os::unix::fs::symlink(&v, run.path.join("planted")).unwrap();
        let e = format!("{:#}", run.private_dir("planted").unwrap_err());
        assert!(e.contains("planted"), "{e}");
        assert!(v.join("sentinel").exists());
        drop(run);
        assert!(!tmp.path().join("run").exists());
        assert!(
            v.join("sentinel").exists(),
            "removal does not follow the link"
        );
    }

    #[test]
    fn stale_run_dirs_of_other_users_and_symlinks_are_kept() {
        let tmp = tempfile::tempdir().unwrap();
        // PIDs above the kernel's maximum (2^22): never alive.
        let stale = |n: &str| tmp.path().join(format!("{}{n}", RunDir::PREFIX));
        let with_sock = |d: &Path| {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("agent.sock"), "").unwrap();
        };
        with_sock(&stale("999999991-a"));
        with_sock(&stale("999999992-b"));
        std::os::unix::fs::chown(stale("999999992-b"), Some(65534), Some(65534)).unwrap();
        let v = victim(tmp.path());
        std::fs::write(v.join("agent.sock"), "").unwrap();
        std::os::unix::fs::symlink(&v, stale("999999993-c")).unwrap();
        RunDir::remove_stale_in(tmp.path());
        assert!(!stale("999999991-a").exists(), "this user's stale dir goes");
        assert!(stale("999999992-b").join("agent.sock").exists());
        assert!(std::fs::symlink_metadata(stale("999999993-c")).is_ok());
        assert!(v.join("sentinel").exists());
    }
}
