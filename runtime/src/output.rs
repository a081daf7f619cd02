//! Worker output: every line prefixed with `[rank N] `, line-buffered, bounded in length, and
//! the last stderr lines kept for the error report.

use std::collections::VecDeque;
use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, BufReader};
use tokio::sync::{mpsc, oneshot};

/// Longest line passed through in one piece; longer lines are split (and the rest of the line
/// follows on continuation lines with the same prefix).
pub const LINE_BYTES_MAX: usize = 16 * 1024;
/// stderr lines kept per worker for the failure report.
pub const TAIL_LINES_MAX: usize = 20;
/// Longest kept tail line.
const TAIL_LINE_BYTES_MAX: usize = 1024;
/// Lines queued for the writer thread (at most this many x [`LINE_BYTES_MAX`] bytes).
const QUEUE_LINES_MAX: usize = 256;

enum Out {
    Line(Stream, Vec<u8>),
    Flush(oneshot::Sender<()>),
}

/// The writer thread's queue. Blocking writes to the agent's stdout and stderr happen on that
/// thread: a reader of our output that stalls fills the queue, then the pumps, then the
/// workers' pipes, but never blocks the agent's event loop (signals, drains, the socket).
fn writer() -> &'static mpsc::Sender<Out> {
    static WRITER: OnceLock<mpsc::Sender<Out>> = OnceLock::new();
    WRITER.get_or_init(|| {
        let (tx, mut rx) = mpsc::channel::<Out>(QUEUE_LINES_MAX);
        let spawned = std::thread::Builder::new()
            .name("worker-output".into())
            .spawn(move || {
                while let Some(msg) = rx.blocking_recv() {
                    match msg {
                        // A closed stdout/stderr is ignored: workers must keep running regardless.
                        Out::Line(Stream::Stdout, line) => {
                            drop(std::io::stdout().lock().write_all(&line))
                        }
                        Out::Line(Stream::Stderr, line) => {
                            drop(std::io::stderr().lock().write_all(&line))
                        }
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

/// Which of the agent's streams a worker stream goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// Copies `input` line by line to the agent's `stream` with a `[rank N] ` prefix until EOF.
/// Each line is written whole by one thread, so lines of different workers never interleave
/// mid-line.
pub async fn pump<R: AsyncRead + Unpin>(input: R, rank: u32, stream: Stream, tail: Option<Tail>) {
    let prefix = format!("[rank {rank}] ");
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
                tracing::debug!(rank, error = %e, "worker output read failed");
                return;
            }
        };
        if n == 0 {
            return;
        }
        if buf.last() != Some(&b'\n') {
            buf.push(b'\n');
        }
        let text = String::from_utf8_lossy(&buf);
        if let Some(t) = &tail {
            t.push(text.trim_end_matches('\n'));
        }
        let mut line = Vec::with_capacity(prefix.len() + buf.len());
        line.extend_from_slice(prefix.as_bytes());
        line.extend_from_slice(&buf);
        if writer().send(Out::Line(stream, line)).await.is_err() {
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

    #[tokio::test]
    async fn pump_splits_long_lines_into_the_tail() {
        let t = Tail::default();
        let mut input = vec![b'a'; LINE_BYTES_MAX + 10];
        input.extend_from_slice(b"\nlast line without newline");
        pump(&input[..], 0, Stream::Stderr, Some(t.clone())).await;
        flush(Duration::from_secs(5)).await;
        let lines = t.lines();
        assert_eq!(
            lines.len(),
            3,
            "{:?}",
            lines.iter().map(|l| l.len()).collect::<Vec<_>>()
        );
        assert_eq!(lines[1], "a".repeat(10));
        assert_eq!(lines[2], "last line without newline");
    }
}
