//! Where a worker's stdout and stderr go, torchrun's `DefaultLogsSpecs`.
//!
//! - By default a worker writes straight to the agent's own stdout and stderr (inherited, no
//!   pipe, no prefix): a terminal stays a terminal.
//! - `--redirects` sends a stream to `stdout.log`/`stderr.log`; `--tee` also copies it to the
//!   console, each line prefixed (`[default0]:`, or `TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`).
//!   A teed stream is redirected too, as in torchrun.
//! - `--local-ranks-filter`: other ranks' unredirected streams go to /dev/null, and their teed
//!   streams only to their files.
//! - `--duplicate-stdout-filters`/`--duplicate-stderr-filters`: teed lines that contain one of
//!   the strings are also appended, prefixed, to `attempt_N/filtered_std{out,err}.log`.
//!
//! Layout (a log dir is in use with `--log-dir`, or when a stream is redirected or teed; then
//! without `--log-dir` the agent makes a `torchelastic_*` directory in the temp dir and keeps
//! it): `LOG_DIR/<run_id>_<random>/attempt_<N>/<local_rank>/{stdout.log,stderr.log,error.json}`,
//! one run folder per agent process. `N` counts the worker groups this agent started (0, 1, ...):
//! torchrun uses the restart count and wipes the folder, but elastic-run also starts new groups
//! on membership changes with the same restart count, so the count of groups is what never
//! overwrites an earlier group's logs. Directories are made 0700 and files 0600, each new
//! (`O_EXCL`): nothing there is followed or overwritten; a symlink at `--log-dir` is refused.

use std::fs::File;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use crate::cli::{Filters, LocalRanks, StdSpec};

/// The variable holding the prefix template of teed lines, torchrun's.
pub const LOG_LINE_PREFIX_TEMPLATE_ENV: &str = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE";
/// Prefix of the log dir the agent makes when none is given, torchrun's.
const TEMP_LOG_DIR_PREFIX: &str = "torchelastic_";
/// Attempts at a fresh random directory name before giving up.
const RANDOM_NAME_ATTEMPTS_MAX: u32 = 16;
/// Longest run-id part of the run folder's name.
const RUN_ID_NAME_CHARS_MAX: usize = 64;

/// The console flags, and the log folder of this agent once made.
#[derive(Debug)]
pub struct Logs {
    redirects: StdSpec,
    tee: StdSpec,
    filter: LocalRanks,
    dup_stdout: Filters,
    dup_stderr: Filters,
    prefix_template: Option<String>,
    role: String,
    run_id: String,
    /// `--log-dir`.
    root: Option<PathBuf>,
    /// `LOG_DIR/<run_id>_<random>`, made for the first group that needs it.
    run_dir: Mutex<Option<PathBuf>>,
    /// Worker groups started so far: the next `attempt_N`.
    attempts: AtomicU32,
}

/// What [`Logs::new`] reads.
#[derive(Debug, Clone, Default)]
pub struct LogsConfig {
    pub redirects: StdSpec,
    pub tee: StdSpec,
    pub local_ranks_filter: LocalRanks,
    pub duplicate_stdout_filters: Filters,
    pub duplicate_stderr_filters: Filters,
    /// `TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`.
    pub prefix_template: Option<String>,
    pub role: String,
    pub run_id: String,
    pub log_dir: Option<PathBuf>,
}

/// Where one stream of one worker goes.
#[derive(Debug)]
pub enum Dest {
    /// The agent's own stream, inherited.
    Console,
    /// /dev/null (`--local-ranks-filter` hides it).
    Null,
    /// Redirected: the worker's stream is this file.
    File(PathBuf, File),
    /// Teed: through a pipe, to the file and the console.
    Tee(Arc<Tee>),
}

/// A teed stream's targets.
#[derive(Debug)]
pub struct Tee {
    pub path: PathBuf,
    pub file: File,
    pub prefix: String,
    /// The attempt's `filtered_std*.log` and what a line must contain to go there.
    pub filtered: Option<(Arc<File>, Filters)>,
    /// Set at the first failed write, so that it is reported once.
    pub write_failed: std::sync::atomic::AtomicBool,
}

/// One worker's streams and error file.
#[derive(Debug)]
pub struct WorkerLogs {
    pub stdout: Dest,
    pub stderr: Dest,
    /// `TORCHELASTIC_ERROR_FILE` in the log dir; `None` when no log dir is in use.
    pub error_file: Option<PathBuf>,
}

/// One worker group's logs.
#[derive(Debug)]
pub struct Attempt {
    /// `attempt_N`, when a log dir is in use.
    pub dir: Option<PathBuf>,
    pub workers: Vec<WorkerLogs>,
}

impl Logs {
    /// Checks `--log-dir` (a file or a symlink there is refused; the message names it);
    /// nothing is created until the first group.
    pub fn new(cfg: LogsConfig) -> Result<Logs, String> {
        if let Some(d) = &cfg.log_dir {
            check_root(d)?;
        }
        Ok(Logs {
            redirects: cfg.redirects,
            tee: cfg.tee,
            filter: cfg.local_ranks_filter,
            dup_stdout: cfg.duplicate_stdout_filters,
            dup_stderr: cfg.duplicate_stderr_filters,
            prefix_template: cfg.prefix_template.filter(|t| !t.is_empty()),
            role: cfg.role,
            run_id: cfg.run_id,
            root: cfg.log_dir,
            run_dir: Mutex::new(None),
            attempts: AtomicU32::new(0),
        })
    }

    /// Every worker inherits the agent's streams, no log dir (tests, and the default flags).
    pub fn inherit(role: &str) -> Logs {
        Logs::new(LogsConfig {
            role: role.to_string(),
            ..LogsConfig::default()
        })
        .expect("no log dir to check")
    }

    /// Whether a log dir is in use: `--log-dir`, or some stream redirected or teed.
    pub fn in_use(&self) -> bool {
        self.root.is_some() || !self.redirects.is_none() || !self.tee.is_none()
    }

    /// The run folder, once made.
    pub fn run_dir(&self) -> Option<PathBuf> {
        self.run_dir
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Lays out the next worker group of `nproc` workers, whose local rank 0 has global rank
    /// `rank_offset`: makes its folders and files, and says where each stream goes.
    pub fn attempt(&self, nproc: u32, rank_offset: u32) -> Result<Attempt, String> {
        let n = self.attempts.fetch_add(1, Ordering::Relaxed);
        let dir = if self.in_use() {
            let run = self.ensure_run_dir()?;
            let dir = run.join(format!("attempt_{n}"));
            make_dir(&dir)?;
            Some(dir)
        } else {
            None
        };
        let filtered =
            |name: &str, filters: &Filters| -> Result<Option<(Arc<File>, Filters)>, String> {
                match &dir {
                    Some(d) if !filters.0.is_empty() => {
                        let p = d.join(name);
                        Ok(Some((Arc::new(create_file(&p)?), filters.clone())))
                    }
                    _ => Ok(None),
                }
            };
        let filtered_out = filtered("filtered_stdout.log", &self.dup_stdout)?;
        let filtered_err = filtered("filtered_stderr.log", &self.dup_stderr)?;
        let mut workers = Vec::with_capacity(nproc as usize);
        for local_rank in 0..nproc {
            let tee = self.tee.of(local_rank);
            let redirect = self.redirects.of(local_rank).union(tee);
            let shows = self.filter.shows(local_rank);
            let plain = || if shows { Dest::Console } else { Dest::Null };
            let Some(d) = &dir else {
                workers.push(WorkerLogs {
                    stdout: plain(),
                    stderr: plain(),
                    error_file: None,
                });
                continue;
            };
            let rank_dir = d.join(local_rank.to_string());
            make_dir(&rank_dir)?;
            let prefix = self.prefix(local_rank, rank_offset + local_rank);
            let dest = |redirected: bool,
                        teed: bool,
                        name: &str,
                        filtered: &Option<(Arc<File>, Filters)>|
             -> Result<Dest, String> {
                if !redirected {
                    return Ok(plain());
                }
                let path = rank_dir.join(name);
                let file = create_file(&path)?;
                if teed && shows {
                    Ok(Dest::Tee(Arc::new(Tee {
                        path,
                        file,
                        prefix: prefix.clone(),
                        filtered: filtered.clone(),
                        write_failed: Default::default(),
                    })))
                } else {
                    Ok(Dest::File(path, file))
                }
            };
            workers.push(WorkerLogs {
                stdout: dest(
                    redirect.has_out(),
                    tee.has_out(),
                    "stdout.log",
                    &filtered_out,
                )?,
                stderr: dest(
                    redirect.has_err(),
                    tee.has_err(),
                    "stderr.log",
                    &filtered_err,
                )?,
                error_file: Some(rank_dir.join("error.json")),
            });
        }
        Ok(Attempt { dir, workers })
    }

    /// The prefix of `local_rank`'s teed lines: torchrun's `[{role}{local_rank}]:`, or the
    /// template with `${role_name}`, `${rank}` (global) and `${local_rank}` substituted.
    pub fn prefix(&self, local_rank: u32, rank: u32) -> String {
        match &self.prefix_template {
            Some(t) => safe_substitute(
                t,
                &[
                    ("role_name", self.role.as_str()),
                    ("rank", &rank.to_string()),
                    ("local_rank", &local_rank.to_string()),
                ],
            ),
            None => format!("[{}{local_rank}]:", self.role),
        }
    }

    fn ensure_run_dir(&self) -> Result<PathBuf, String> {
        let mut run = self.run_dir.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = &*run {
            return Ok(r.clone());
        }
        let root = match &self.root {
            Some(r) => {
                check_root(r)?;
                if !r.exists() {
                    std::fs::DirBuilder::new()
                        .recursive(true)
                        .mode(0o700)
                        .create(r)
                        .map_err(|e| format!("create --log-dir {}: {e}", r.display()))?;
                }
                r.clone()
            }
            None => make_random_dir(&std::env::temp_dir(), TEMP_LOG_DIR_PREFIX)?,
        };
        let name: String = sanitize(&self.run_id)
            .chars()
            .take(RUN_ID_NAME_CHARS_MAX)
            .collect();
        let dir = make_random_dir(&root, &format!("{name}_"))?;
        tracing::info!(dir = %dir.display(), "worker logs go to this directory");
        *run = Some(dir.clone());
        Ok(dir)
    }
}

/// `--log-dir` must be a directory or absent, and not a symlink.
fn check_root(d: &Path) -> Result<(), String> {
    match std::fs::symlink_metadata(d) {
        Ok(m) if m.file_type().is_symlink() => Err(format!(
            "--log-dir {} is a symlink: refusing to follow it (give the directory it points to)",
            d.display()
        )),
        Ok(m) if !m.is_dir() => Err(format!(
            "--log-dir {} is a file, not a directory",
            d.display()
        )),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("--log-dir {}: {e}", d.display())),
    }
}

/// A new directory, mode 0700; mkdir never follows a symlink in its last component, and an
/// existing name is an error rather than reused.
fn make_dir(p: &Path) -> Result<(), String> {
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(p)
        .map_err(|e| format!("create log dir {}: {e}", p.display()))
}

/// A new file, mode 0600, never through a symlink nor over an existing file.
fn create_file(p: &Path) -> Result<File, String> {
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(p)
        .map_err(|e| format!("create log file {}: {e}", p.display()))
}

/// `parent/<prefix><random>`, new, mode 0700.
fn make_random_dir(parent: &Path, prefix: &str) -> Result<PathBuf, String> {
    let mut last = String::new();
    for _ in 0..RANDOM_NAME_ATTEMPTS_MAX {
        let p = parent.join(format!("{prefix}{}", random_suffix()));
        match std::fs::DirBuilder::new().mode(0o700).create(&p) {
            Ok(()) => return Ok(p),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                last = e.to_string();
            }
            Err(e) => return Err(format!("create log dir {}: {e}", p.display())),
        }
    }
    Err(format!(
        "no fresh directory name under {} after {RANDOM_NAME_ATTEMPTS_MAX} tries: {last}",
        parent.display()
    ))
}

/// Eight lowercase letters and digits, from the OS's random source (the clock and PID when
/// it cannot be read).
fn random_suffix() -> String {
    use std::io::Read;
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789_";
    let mut bytes = [0u8; 8];
    let read = File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if read.is_err() {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        bytes = (nanos ^ (u64::from(std::process::id()) << 32)).to_le_bytes();
    }
    bytes
        .iter()
        .map(|b| ALPHABET[usize::from(*b) % ALPHABET.len()] as char)
        .collect()
}

fn sanitize(s: &str) -> String {
    let s: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    match s.trim_start_matches('.') {
        "" => "_".to_string(),
        t => t.to_string(),
    }
}

/// Python's `string.Template.safe_substitute`: `$name` and `${name}` of known names are
/// replaced, `$$` is `$`, anything else stays as written.
pub fn safe_substitute(template: &str, vars: &[(&str, &str)]) -> String {
    let lookup = |name: &str| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| *v);
    let is_start = |c: char| c == '_' || c.is_ascii_alphabetic();
    let is_ident = |c: char| c == '_' || c.is_ascii_alphanumeric();
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(a) = after.strip_prefix('$') {
            out.push('$');
            rest = a;
        } else if let Some(inner) = after.strip_prefix('{')
            && let Some(end) = inner.find('}')
            && let Some(v) = lookup(&inner[..end])
        {
            out.push_str(v);
            rest = &inner[end + 1..];
        } else if after.starts_with(is_start) {
            let end = after.find(|c| !is_ident(c)).unwrap_or(after.len());
            match lookup(&after[..end]) {
                Some(v) => out.push_str(v),
                None => {
                    out.push('$');
                    out.push_str(&after[..end]);
                }
            }
            rest = &after[end..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::Std;

    fn mode(p: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn templates_substitute_like_python_safe_substitute() {
        let v = [("rank", "3"), ("local_rank", "1"), ("role_name", "trainer")];
        assert_eq!(safe_substitute("[rank ${rank}] ", &v), "[rank 3] ");
        assert_eq!(safe_substitute("$role_name-$local_rank:", &v), "trainer-1:");
        assert_eq!(
            safe_substitute("$$ ${nope} $nope ${rank $ x$", &v),
            "$ ${nope} $nope ${rank $ x$"
        );
        assert_eq!(safe_substitute("${rank}${rank}", &v), "33");
    }

    #[test]
    fn default_prefix_is_torchruns_and_the_template_sees_the_global_rank() {
        let mut cfg = LogsConfig {
            role: "default".into(),
            ..LogsConfig::default()
        };
        let logs = Logs::new(cfg.clone()).unwrap();
        assert_eq!(logs.prefix(1, 5), "[default1]:");
        cfg.prefix_template = Some("[${role_name}:${rank}/${local_rank}] ".into());
        let logs = Logs::new(cfg).unwrap();
        assert_eq!(logs.prefix(1, 5), "[default:5/1] ");
    }

    #[test]
    fn no_flags_inherit_and_use_no_log_dir() {
        let logs = Logs::inherit("default");
        assert!(!logs.in_use());
        let a = logs.attempt(2, 0).unwrap();
        assert!(a.dir.is_none());
        for w in &a.workers {
            assert!(matches!(w.stdout, Dest::Console) && matches!(w.stderr, Dest::Console));
            assert!(w.error_file.is_none());
        }
    }

    #[test]
    fn layout_modes_and_attempts_that_never_reuse_a_folder() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("logs");
        let logs = Logs::new(LogsConfig {
            redirects: StdSpec::PerRank(vec![(0, Std::OUT)]),
            tee: StdSpec::PerRank(vec![(1, Std::ERR)]),
            local_ranks_filter: LocalRanks([0].into_iter().collect()),
            duplicate_stdout_filters: Filters(vec!["x".into()]),
            role: "default".into(),
            run_id: "job/1".into(),
            log_dir: Some(root.clone()),
            ..LogsConfig::default()
        })
        .unwrap();
        let a = logs.attempt(3, 0).unwrap();
        let run = logs.run_dir().unwrap();
        assert_eq!(run.parent().unwrap(), root);
        assert!(
            run.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("job_1_")
        );
        let dir = a.dir.clone().unwrap();
        assert_eq!(dir, run.join("attempt_0"));
        // Rank 0: stdout to its file, stderr to the console; rank 1 is filtered out: its teed
        // stderr only to the file, its stdout to /dev/null; rank 2: console, hidden.
        assert!(matches!(&a.workers[0].stdout, Dest::File(p, _) if p.ends_with("0/stdout.log")));
        assert!(matches!(a.workers[0].stderr, Dest::Console));
        assert!(matches!(&a.workers[1].stderr, Dest::File(p, _) if p.ends_with("1/stderr.log")));
        assert!(matches!(a.workers[1].stdout, Dest::Null));
        assert!(matches!(a.workers[2].stdout, Dest::Null));
        assert_eq!(
            a.workers[2].error_file.as_deref(),
            Some(dir.join("2/error.json").as_path())
        );
        for p in [&root, &run, &dir, &dir.join("0")] {
            assert_eq!(mode(p), 0o700, "{}", p.display());
        }
        for p in [dir.join("0/stdout.log"), dir.join("filtered_stdout.log")] {
            assert_eq!(mode(&p), 0o600, "{}", p.display());
        }
        assert!(!dir.join("filtered_stderr.log").exists());
        let b = logs.attempt(3, 0).unwrap();
        assert_eq!(b.dir.unwrap(), run.join("attempt_1"));
        assert_eq!(logs.run_dir().unwrap(), run);
    }

    #[test]
    fn a_tee_shown_on_the_console_goes_through_the_pump_with_its_prefix() {
        let tmp = tempfile::tempdir().unwrap();
        let logs = Logs::new(LogsConfig {
            tee: StdSpec::All(Std::OUT),
            role: "trainer".into(),
            run_id: "r".into(),
            log_dir: Some(tmp.path().to_path_buf()),
            ..LogsConfig::default()
        })
        .unwrap();
        let a = logs.attempt(1, 4).unwrap();
        let Dest::Tee(t) = &a.workers[0].stdout else {
            panic!("{:?}", a.workers[0].stdout)
        };
        assert_eq!(t.prefix, "[trainer0]:");
        assert!(t.filtered.is_none());
        assert!(matches!(a.workers[0].stderr, Dest::Console));
    }

    #[test]
    fn a_file_or_a_symlink_as_log_dir_is_refused_naming_it() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("f");
        std::fs::write(&file, "").unwrap();
        let link = tmp.path().join("l");
        std::os::unix::fs::symlink(tmp.path(), &link).unwrap();
        for (p, what) in [(&file, "is a file"), (&link, "is a symlink")] {
            let e = Logs::new(LogsConfig {
                log_dir: Some(p.clone()),
                ..LogsConfig::default()
            })
            .unwrap_err();
            assert!(
                e.contains(&p.display().to_string()) && e.contains(what),
                "{e}"
            );
        }
    }
}
