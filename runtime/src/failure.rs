//! Why a worker group failed, as torchrun reports it: [`WorkerFailure`] (rank, exit code or
//! signal, pid, time, error file, traceback, the other ranks that failed with it), its
//! root-cause summary ([`WorkerFailure::summary`], torchrun's `ChildFailedError` block), and
//! the error file a worker decorated with torch's `@record` writes ([`read_error_record`]).

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::SystemTime;

/// Longest error file read from a worker.
const ERROR_FILE_BYTES_MAX: u64 = 1024 * 1024;

/// The failure that ended a job: which worker, its exit code and what it said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerFailure {
    pub rank: u32,
    pub local_rank: u32,
    /// The worker's exit code, 128 + signal for a signal, 1 for a hang or a spawn failure.
    pub exit_code: i32,
    /// The signal that killed it.
    pub signal: Option<i32>,
    pub pid: Option<u32>,
    /// When the agent saw it fail, or the error file's timestamp when it has one.
    pub time: SystemTime,
    /// The error file, when the worker wrote one.
    pub error_file: Option<PathBuf>,
    /// torchrun's traceback: the error file's `py_callstack`, else its message.
    pub traceback: Option<String>,
    /// From `TORCHELASTIC_ERROR_FILE` when the worker wrote one, else its last stderr lines
    /// (when stderr passed through the agent or went to a file), else what is known.
    pub message: String,
    pub restarts: u32,
    /// Other workers of the group that had failed when the first failure was seen.
    pub others: Vec<WorkerFailure>,
}

/// torchrun's traceback line when a worker left no error file.
pub const NO_TRACEBACK: &str =
    "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html";
/// torchrun's value for what is not known.
pub(crate) const NOT_AVAILABLE: &str = "<N/A>";
/// The summary's border is as wide as its widest line, up to this, as torchrun's.
const SUMMARY_WIDTH_MAX: usize = 60;

impl WorkerFailure {
    /// A failure known only by its rank, exit code and a message (a hang, a spawn failure).
    pub fn new(rank: u32, local_rank: u32, exit_code: i32, message: String, restarts: u32) -> Self {
        WorkerFailure {
            rank,
            local_rank,
            exit_code,
            signal: None,
            pid: None,
            time: SystemTime::now(),
            error_file: None,
            traceback: None,
            message,
            restarts,
            others: Vec::new(),
        }
    }

    /// torchrun's root-cause summary (`ChildFailedError.format_msg`) of this failure and the
    /// others seen with it, titled `<name> FAILED`, on `host`.
    pub fn summary(&self, name: &str, host: &str) -> String {
        let title = format!("{name} FAILED");
        let mut all: Vec<&WorkerFailure> = std::iter::once(self).chain(&self.others).collect();
        all.sort_by_key(|f| f.rank);
        let mut root = String::new();
        let mut others = Vec::new();
        let mut width = title.chars().count();
        for (idx, f) in all.iter().enumerate() {
            let block = f.summary_block(idx, host);
            width = width.max(block.lines().map(|l| l.chars().count()).max().unwrap_or(0));
            if std::ptr::eq(*f, self) {
                root = block;
            } else {
                others.push(block);
            }
        }
        let width = width.min(SUMMARY_WIDTH_MAX);
        let others = if others.is_empty() {
            "  <NO_OTHER_FAILURES>".to_string()
        } else {
            others.join("\n")
        };
        let border = "=".repeat(width);
        let section = "-".repeat(width);
        format!(
            "\n{border}\n{title}\n{section}\nFailures:\n{others}\n{section}\nRoot Cause (first observed failure):\n{root}\n{border}"
        )
    }

    fn summary_block(&self, idx: usize, host: &str) -> String {
        let (exitcode, signal) = match self.signal {
            Some(sig) => (-sig, format!(" ({})", signal_name(sig))),
            None => (self.exit_code, String::new()),
        };
        let traceback = match (&self.traceback, self.signal) {
            (Some(t), _) => t.clone(),
            (None, Some(sig)) => format!(
                "Signal {sig} ({}) received by PID {}",
                signal_name(sig),
                self.pid
                    .map_or(NOT_AVAILABLE.to_string(), |p| p.to_string())
            ),
            (None, None) => NO_TRACEBACK.to_string(),
        };
        format!(
            "[{idx}]:\n  time      : {}\n  host      : {host}\n  rank      : {} (local_rank: {})\n  exitcode  : {exitcode} (pid: {}){signal}\n  error_file: {}\n  traceback : {}",
            local_time(self.time),
            self.rank,
            self.local_rank,
            self.pid
                .map_or(NOT_AVAILABLE.to_string(), |p| p.to_string()),
            self.error_file
                .as_ref()
                .map_or(NOT_AVAILABLE.to_string(), |p| p.display().to_string()),
            traceback.trim_end().replace('\n', "\n  "),
        )
    }
}

/// `SIGKILL` for 9: the name torchrun shows.
pub fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        _ => return format!("signal {sig}"),
    };
    name.to_string()
}

/// `YYYY-MM-DD_HH:MM:SS` in local time, as torchrun prints a failure's time.
fn local_time(t: SystemTime) -> String {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as libc::time_t;
    // SAFETY: localtime_r writes only into `tm`, which lives on this stack frame.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    if unsafe { libc::localtime_r(&secs, &mut tm) }.is_null() {
        return NOT_AVAILABLE.to_string();
    }
    format!(
        "{:04}-{:02}-{:02}_{:02}:{:02}:{:02}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec
    )
}

/// This machine's host name, for the summary.
pub fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into `buf`.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return NOT_AVAILABLE.to_string();
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// The summary's title: the script for a Python command (`train.py`, or the module), else
/// the program, as torchrun names its entrypoint.
pub fn entrypoint_name(argv: &[String]) -> String {
    let Some((program, args)) = argv.split_first() else {
        return String::new();
    };
    let base = Path::new(program)
        .file_name()
        .map_or(program.clone(), |b| b.to_string_lossy().into_owned());
    if !base.starts_with("python") {
        return program.clone();
    }
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-c" => return program.clone(),
            "-m" => return it.next().cloned().unwrap_or_else(|| program.clone()),
            a if a.starts_with('-') => {}
            a => return a.to_string(),
        }
    }
    program.clone()
}

impl std::fmt::Display for WorkerFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "worker rank {} (local rank {}) failed with exit code {} after {} restart(s)",
            self.rank, self.local_rank, self.exit_code, self.restarts
        )?;
        if !self.message.is_empty() {
            write!(f, ":\n{}", self.message)?;
        }
        Ok(())
    }
}

/// The exit code to report: the worker's own, or 128 + the signal that killed it (the shell's
/// convention).
pub fn exit_code(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(c), _) => c,
        (None, Some(sig)) => 128 + sig,
        (None, None) => 1,
    }
}

/// What a worker recorded in its error file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorRecord {
    /// `message.message` (or a plain `message`).
    pub message: String,
    /// What torchrun's summary shows: `extraInfo.py_callstack`, else the message.
    pub traceback: String,
    /// `extraInfo.timestamp`, seconds since the epoch.
    pub timestamp: Option<u64>,
}

impl ErrorRecord {
    /// The message and the call stack, for the one-line report.
    pub(crate) fn text(&self) -> String {
        match (self.message.is_empty(), self.traceback == self.message) {
            (true, _) | (false, true) => self.traceback.trim_end().to_string(),
            (false, false) => format!("{}\n{}", self.message, self.traceback.trim_end()),
        }
    }
}

/// Reads the error a worker recorded through torch's `@record` (or any JSON in that shape):
/// `{"message": {"message": "...", "extraInfo": {"py_callstack": "...", "timestamp": "..."}}}`,
/// or `{"message": "..."}`.
pub fn read_error_record(path: &Path) -> Option<ErrorRecord> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .ok()?;
    let mut bytes = Vec::new();
    f.take(ERROR_FILE_BYTES_MAX).read_to_end(&mut bytes).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let msg = v.get("message")?;
    if let Some(s) = msg.as_str() {
        return Some(ErrorRecord {
            message: s.to_string(),
            traceback: s.to_string(),
            timestamp: None,
        });
    }
    let text = msg
        .get("message")
        .and_then(|m| m.as_str())
        .unwrap_or("")
        .to_string();
    let extra = msg.get("extraInfo");
    let stack = extra
        .and_then(|e| e.get("py_callstack"))
        .and_then(|s| s.as_str())
        .unwrap_or("");
    let timestamp = extra.and_then(|e| e.get("timestamp")).and_then(|t| {
        t.as_u64()
            .or_else(|| t.as_str().and_then(|s| s.trim().parse().ok()))
    });
    if text.is_empty() && stack.is_empty() {
        return None;
    }
    Some(ErrorRecord {
        traceback: if stack.is_empty() {
            text.clone()
        } else {
            stack.to_string()
        },
        message: text,
        timestamp,
    })
}

/// [`read_error_record`]'s message and call stack as one text.
pub fn read_error_file(path: &Path) -> Option<String> {
    read_error_record(path).map(|r| r.text())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_file_in_torch_record_format_is_read() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("error.json");
        std::fs::write(
            &p,
            r#"{"message":{"message":"ValueError: boom","extraInfo":{"py_callstack":"Traceback...\nValueError: boom\n","timestamp":"1"}}}"#,
        )
        .unwrap();
        assert_eq!(
            read_error_file(&p).unwrap(),
            "ValueError: boom\nTraceback...\nValueError: boom"
        );
        std::fs::write(&p, r#"{"message":"plain"}"#).unwrap();
        assert_eq!(read_error_file(&p).unwrap(), "plain");
        for bad in ["", "[]", "{\"message\":{}}", "{\"nope\":1}"] {
            std::fs::write(&p, bad).unwrap();
            assert_eq!(read_error_file(&p), None, "{bad}");
        }
        assert_eq!(read_error_file(&tmp.path().join("missing")), None);
    }

    #[test]
    fn signals_map_to_shell_exit_codes() {
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGKILL)), 128 + 9);
    }

    #[test]
    fn the_summary_is_torchruns_block() {
        let mut root = WorkerFailure::new(1, 1, 1, "m".into(), 0);
        root.pid = Some(42);
        root.error_file = Some("/l/attempt_0/1/error.json".into());
        root.traceback = Some("Traceback (most recent call last):\n  x\nValueError: v\n".into());
        let mut other = WorkerFailure::new(0, 0, 137, "k".into(), 0);
        other.signal = Some(9);
        other.pid = Some(41);
        root.others.push(other);
        let s = root.summary("train.py", "host-a");
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[0], "");
        // As wide as the widest line (the signal's traceback here), at most 60.
        let widest = "  traceback : Signal 9 (SIGKILL) received by PID 41".len();
        assert_eq!(lines[1], "=".repeat(widest));
        assert_eq!(lines[3], "-".repeat(widest));
        assert_eq!(*lines.last().unwrap(), lines[1]);
        assert_eq!(lines[2], "train.py FAILED");
        assert_eq!(lines[4], "Failures:");
        assert_eq!(lines[5], "[0]:");
        assert!(s.contains("  rank      : 0 (local_rank: 0)\n  exitcode  : -9 (pid: 41) (SIGKILL)\n  error_file: <N/A>\n  traceback : Signal 9 (SIGKILL) received by PID 41\n"), "{s}");
        assert!(
            s.contains("Root Cause (first observed failure):\n[1]:\n"),
            "{s}"
        );
        assert!(s.contains("  host      : host-a\n  rank      : 1 (local_rank: 1)\n  exitcode  : 1 (pid: 42)\n  error_file: /l/attempt_0/1/error.json\n  traceback : Traceback (most recent call last):\n    x\n  ValueError: v\n="), "{s}");
        let alone = WorkerFailure::new(3, 0, 2, String::new(), 0).summary("sh", "h");
        assert!(
            alone.contains("Failures:\n  <NO_OTHER_FAILURES>\n"),
            "{alone}"
        );
        assert!(
            alone.contains(&format!("traceback : {NO_TRACEBACK}")),
            "{alone}"
        );
        assert!(alone.contains("(pid: <N/A>)"), "{alone}");
    }

    #[test]
    fn the_entrypoint_is_named_as_torchrun_names_it() {
        let v = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            entrypoint_name(&v(&["/usr/bin/python3", "-u", "train.py", "--lr"])),
            "train.py"
        );
        assert_eq!(
            entrypoint_name(&v(&["python3", "-m", "pkg.main"])),
            "pkg.main"
        );
        assert_eq!(entrypoint_name(&v(&["python", "-c", "code"])), "python");
        assert_eq!(entrypoint_name(&v(&["sh", "-c", "x"])), "sh");
    }
}
