//! Teed worker output (`--tee`): every line to the worker's log file as it came, and to the
//! agent's console with its prefix, line-buffered and bounded in length; the last stderr lines
//! kept for the error report. Streams that are not teed never pass through the agent (see
//! [`crate::logs`]); the tail of a redirected stderr is read back from its file.

use std::collections::VecDeque;
use std::io::{Read, Seek, Write};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, BufReader};
use tokio::sync::{mpsc, oneshot};

use crate::logs::Tee;

/// Longest line passed through in one piece; longer lines are split (and the rest of the line
/// follows on continuation lines with the same prefix).
pub const LINE_BYTES_MAX: usize = 16 * 1024;
/// stderr lines kept per worker for the failure report.
pub const TAIL_LINES_MAX: usize = 20;
/// Longest kept tail line.
const TAIL_LINE_BYTES_MAX: usize = 1024;
/// Lines queued for the writer thread (at most this many x [`LINE_BYTES_MAX`] bytes).
const QUEUE_LINES_MAX: usize = 256;
/// How much of the end of a redirected stderr file is read back for the tail.
const FILE_TAIL_BYTES_MAX: u64 = 64 * 1024;

enum Out {
    /// One line (or a piece of a long one) of a teed stream: `bytes` exactly as read;
    /// `filtered` when it also goes to the attempt's filtered file.
    Line {
        to: Arc<Tee>,
        stream: Stream,
        bytes: Vec<u8>,
        filtered: bool,
    },
    Flush(oneshot::Sender<()>),
}

/// The writer thread's queue. Blocking writes to the agent's stdout and stderr and to the log
/// files happen on that thread: a reader of our output (or a disk) that stalls fills the
/// queue, then the pumps, then the workers' pipes, but never blocks the agent's event loop
/// (signals, drains, the socket).
fn writer() -> &'static mpsc::Sender<Out> {
    static WRITER: OnceLock<mpsc::Sender<Out>> = OnceLock::new();
    WRITER.get_or_init(|| {
        let (tx, mut rx) = mpsc::channel::<Out>(QUEUE_LINES_MAX);
        let spawned = std::thread::Builder::new()
            .name("worker-output".into())
            .spawn(move || {
                while let Some(msg) = rx.blocking_recv() {
                    match msg {
                        Out::Line {
                            to,
                            stream,
                            bytes,
                            filtered,
                        } => write_line(&to, stream, &bytes, filtered),
                        Out::Flush(done) => drop(done.send(())),
                    }
                }
            });
        if let Err(e) = spawned {
            // Without the thread every send fails and lines are dropped; say so once.
            eprintln!("elastic-run: cannot start the output thread: {e}");
        }
        tx
    })
}

/// Writes one teed line to its file as it came, and with its prefix (and a newline when it
/// had none) to the console and, when `filtered`, the filtered file.
fn write_line(to: &Tee, stream: Stream, bytes: &[u8], filtered: bool) {
    let mut line = Vec::with_capacity(to.prefix.len() + bytes.len() + 1);
    line.extend_from_slice(to.prefix.as_bytes());
    line.extend_from_slice(bytes);
    if line.last() != Some(&b'\n') {
        line.push(b'\n');
    }
    let mut failed = (&to.file).write_all(bytes).err();
    if filtered && let Some((f, _)) = &to.filtered {
        failed = failed.or((&**f).write_all(&line).err());
    }
    if let Some(e) = failed
        && !to
            .write_failed
            .swap(true, std::sync::atomic::Ordering::Relaxed)
    {
        tracing::warn!(file = %to.path.display(), error = %e, "cannot write a worker's log file");
    }
    // A closed stdout/stderr is ignored: workers must keep running regardless.
    let _ = match stream {
        Stream::Stdout => std::io::stdout().lock().write_all(&line),
        Stream::Stderr => std::io::stderr().lock().write_all(&line),
    };
}

/// Waits until every line queued so far is written, for at most `limit`.
pub async fn flush(limit: Duration) {
    let (tx, rx) = oneshot::channel();
    let _ = tokio::time::timeout(limit, async {
        if writer().send(Out::Flush(tx)).await.is_ok() {
            let _ = rx.await;
        }
    })
    .await;
}

/// The last stderr lines of one worker.
#[derive(Debug, Default, Clone)]
pub struct Tail(Arc<Mutex<VecDeque<String>>>);

impl Tail {
    fn push(&self, line: &str) {
        let mut q = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() == TAIL_LINES_MAX {
            q.pop_front();
        }
        let mut end = line.len().min(TAIL_LINE_BYTES_MAX);
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        q.push_back(line[..end].to_string());
    }

    /// The last lines of the file at `path` (a redirected stderr), read from its end.
    pub fn of_file(path: &Path) -> Tail {
        let t = Tail::default();
        let Ok(text) = read_end(path) else {
            return t;
        };
        for line in text.lines() {
            t.push(line);
        }
        t
    }

    /// The kept lines, oldest first.
    pub fn lines(&self) -> Vec<String> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }
}

/// The last [`FILE_TAIL_BYTES_MAX`] bytes of `path`, from the first whole line on; a
/// symlink there is not followed.
fn read_end(path: &Path) -> std::io::Result<String> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    let len = f.metadata()?.len();
    let from = len.saturating_sub(FILE_TAIL_BYTES_MAX);
    f.seek(std::io::SeekFrom::Start(from))?;
    let mut bytes = Vec::new();
    f.take(FILE_TAIL_BYTES_MAX).read_to_end(&mut bytes)?;
    let text = String::from_utf8_lossy(&bytes).into_owned();
    Ok(match (from, text.split_once('\n')) {
        (0, _) | (_, None) => text,
        (_, Some((_, rest))) => rest.to_string(),
    })
}

/// Which of the agent's streams a worker stream goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// Copies `input` line by line to the teed stream's file and, prefixed, to the agent's
/// `stream`, until EOF. Each line is written whole by one thread, so lines of different
/// workers never interleave mid-line; a `\r` inside a line (a progress bar) stays in it.
pub async fn pump<R: AsyncRead + Unpin>(
    input: R,
    to: Arc<Tee>,
    stream: Stream,
    tail: Option<Tail>,
) {
    let mut reader = BufReader::new(input);
    let mut buf = Vec::with_capacity(256);
    loop {
        buf.clear();
        let n = match (&mut reader)
            .take(LINE_BYTES_MAX as u64)
            .read_until(b'\n', &mut buf)
            .await
        {
            Ok(n) => n,
            Err(e) => {
                tracing::debug!(file = %to.path.display(), error = %e, "worker output read failed");
                return;
            }
        };
        if n == 0 {
            return;
        }
        let text = String::from_utf8_lossy(&buf);
        if let Some(t) = &tail {
            t.push(text.trim_end_matches('\n'));
        }
        let filtered = to.filtered.as_ref().is_some_and(|(_, f)| f.matches(&text));
        let msg = Out::Line {
            to: to.clone(),
            stream,
            bytes: std::mem::take(&mut buf),
            filtered,
        };
        if writer().send(msg).await.is_err() {
            // No writer: keep draining so the worker never blocks on its pipe.
            continue;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_last_lines_bounded() {
        let t = Tail::default();
        for i in 0..100 {
            t.push(&format!("line {i}"));
        }
        let lines = t.lines();
        assert_eq!(lines.len(), TAIL_LINES_MAX);
        assert_eq!(lines.last().unwrap(), "line 99");
        t.push(&"é".repeat(TAIL_LINE_BYTES_MAX));
        assert!(t.lines().last().unwrap().len() <= TAIL_LINE_BYTES_MAX);
    }

    fn tee(dir: &Path, filters: &[&str]) -> Arc<Tee> {
        let path = dir.join("stderr.log");
        let filtered = (!filters.is_empty()).then(|| {
            let f = std::fs::File::create(dir.join("filtered.log")).unwrap();
            (
                Arc::new(f),
                crate::cli::Filters(filters.iter().map(|s| s.to_string()).collect()),
            )
        });
        Arc::new(Tee {
            file: std::fs::File::create(&path).unwrap(),
            path,
            prefix: "[p0]:".into(),
            filtered,
            write_failed: Default::default(),
        })
    }

    #[tokio::test]
    async fn pump_splits_long_lines_into_the_tail_and_keeps_the_files_bytes_exact() {
        let tmp = tempfile::tempdir().unwrap();
        let t = Tail::default();
        let mut input = vec![b'a'; LINE_BYTES_MAX + 10];
        input.extend_from_slice(b"\nprogress 1\rprogress 2\nlast line without newline");
        pump(
            &input[..],
            tee(tmp.path(), &["progress"]),
            Stream::Stderr,
            Some(t.clone()),
        )
        .await;
        flush(Duration::from_secs(5)).await;
        let lines = t.lines();
        assert_eq!(
            lines.len(),
            4,
            "{:?}",
            lines.iter().map(|l| l.len()).collect::<Vec<_>>()
        );
        assert_eq!(lines[1], "a".repeat(10));
        assert_eq!(lines[3], "last line without newline");
        assert_eq!(std::fs::read(tmp.path().join("stderr.log")).unwrap(), input);
        assert_eq!(
            std::fs::read_to_string(tmp.path().join("filtered.log")).unwrap(),
            "[p0]:progress 1\rprogress 2\n"
        );
    }

    #[test]
    fn the_tail_of_a_redirected_file_is_its_last_lines() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("stderr.log");
        let mut text = "x".repeat(FILE_TAIL_BYTES_MAX as usize);
        for i in 0..30 {
            text.push_str(&format!("\nline {i}"));
        }
        std::fs::write(&p, &text).unwrap();
        let lines = Tail::of_file(&p).lines();
        assert_eq!(lines.len(), TAIL_LINES_MAX);
        assert_eq!(lines.last().unwrap(), "line 29");
        assert!(
            Tail::of_file(&tmp.path().join("missing"))
                .lines()
                .is_empty()
        );
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        assert!(Tail::of_file(&link).lines().is_empty());
    }
}
