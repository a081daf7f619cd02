//! `restore --into-parent`: the reader's answers on stdin.

use checkpoint::CancellationToken;

/// The longest `restore --into-parent` waits for the reader's answer to a header (it answers
/// once it has checked the header against its state: milliseconds).
const TARGETS_ANSWER_TIMEOUT_MS: u64 = 60_000;
/// How often a restore waiting for that answer looks whether it was cancelled.
const TARGETS_POLL_MS: u64 = 100;

/// The reader's answers on stdin for `restore --into-parent`: a line each, at most
/// [`checkpoint::restore::TARGETS_LINE_BYTES_MAX`] bytes, each within
/// [`TARGETS_ANSWER_TIMEOUT_MS`] of its question. Read on a thread of its own, so that a
/// reader that never answers holds up neither a cancelled restore nor the process's exit.
pub(crate) fn reader_targets(cancel: &CancellationToken) -> checkpoint::restore::IntoProcess {
    use std::io::{BufRead, Read};
    let (tx, rx) = std::sync::mpsc::sync_channel::<Result<String, String>>(1);
    std::thread::spawn(move || {
        let mut input = std::io::BufReader::new(std::io::stdin());
        loop {
            let mut line = String::new();
            let got = (&mut input)
                .take(checkpoint::restore::TARGETS_LINE_BYTES_MAX)
                .read_line(&mut line);
            let last = !matches!(&got, Ok(n) if *n > 0 && line.ends_with('\n'));
            let sent = match got {
                Ok(0) => Err("its input ended before it answered".to_string()),
                Ok(n) if !line.ends_with('\n') => Err(format!("no end of line within {n} bytes")),
                Ok(_) => Ok(line),
                Err(e) => Err(e.to_string()),
            };
            if tx.send(sent).is_err() || last {
                return;
            }
        }
    });
    let rx = std::sync::Mutex::new(rx);
    let cancel = cancel.clone();
    checkpoint::restore::IntoProcess::parent(std::sync::Arc::new(move |step, name: &str| {
        let bad = |why: String| {
            checkpoint::Error::InvalidInput(format!("the reader's targets for {name}: {why}"))
        };
        let rx = rx.lock().unwrap_or_else(|e| e.into_inner());
        let asked = std::time::Instant::now();
        loop {
            match rx.recv_timeout(std::time::Duration::from_millis(TARGETS_POLL_MS)) {
                Ok(Ok(line)) => return checkpoint::restore::parse_targets(&line, step, name),
                Ok(Err(why)) => return Err(bad(why)),
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(bad("its input ended before it answered".into()));
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) if cancel.is_cancelled() => {
                    return Err(checkpoint::Error::Cancelled {
                        op: format!("waiting for the reader's targets for {name}"),
                    });
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    if asked.elapsed()
                        >= std::time::Duration::from_millis(TARGETS_ANSWER_TIMEOUT_MS)
                    {
                        return Err(checkpoint::Error::Timeout {
                            op: format!("waiting for the reader's targets for {name}"),
                            deadline_ms: TARGETS_ANSWER_TIMEOUT_MS,
                        });
                    }
                }
            }
        }
    }))
}
