//! A restore that writes its output into the memory of the process that reads it
//! ([`IntoProcess`], `elastic-ckpt restore --events --into-parent`, which
//! `elastic_run.load_from` runs): the reader names, for each output, the addresses in its own
//! memory that each byte range of it goes to (its tensors), and the restore copies each
//! decoded block there with `process_vm_writev(2)`. No file is written, so a byte goes from
//! the store's body into the tensor in one copy; without it, each byte is written into a
//! file (whose new pages the kernel allocates and zeroes) and read again by the reader.
//!
//! Only the reader's parent-child bond makes this safe to use: a restore writes only into the
//! process that started it, once that process has named itself (its pid in the answer: a
//! wrapper in between gets the file instead), only into the ranges it named, and it is
//! killed when its parent exits (and checks that it has the same parent before each write).
//! The reader holds the named memory until the restore has exited.
//!
//! Bytes go into the reader's memory as they are decoded; a chunk is checked once all of it
//! is there (a block of a ranged read, before it is written). So only a read that ends
//! without error has delivered the step: after a failed one, the named memory may hold bytes
//! that failed their check.

use std::sync::Arc;

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::local::DurableFile;

/// The most ranges a reader may name for one output (a range per tensor, so far more than any
/// state holds), which bounds what one answer costs to read and check.
pub const TARGETS_MAX: usize = 1 << 22;
/// The longest answer line [`parse_targets`] reads: [`TARGETS_MAX`] ranges of three numbers.
pub const TARGETS_LINE_BYTES_MAX: u64 = 256 << 20;
/// The most ranges one `process_vm_writev` call takes (Linux's `IOV_MAX`).
const IOV_MAX: usize = 1024;

/// Where one range of an output goes: bytes `[offset, offset + len)` of the output file
/// (as a restore would have written it) to address `addr` of the reader.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(from = "[u64; 3]")]
pub struct Target {
    pub offset: u64,
    pub len: u64,
    pub addr: u64,
}

impl From<[u64; 3]> for Target {
    fn from([offset, len, addr]: [u64; 3]) -> Self {
        Target { offset, len, addr }
    }
}

/// A reader's answer for one output: its process id, and where the output's bytes go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReaderTargets {
    pub pid: i32,
    pub ranges: Vec<Target>,
}

/// Asked once for each output of a step, after its [`super::ReadEvent::Header`]: the
/// targets of the output named (`step`, `name`), or None when the reader wants the output
/// written as a file instead.
pub type Targets = Arc<dyn Fn(u64, &str) -> Result<Option<ReaderTargets>> + Send + Sync>;

/// Which process a restore writes into, and how it learns where.
#[derive(Clone)]
pub struct IntoProcess {
    pid: i32,
    /// Whether `pid` is this process's parent, checked again before every write.
    parent: bool,
    pub(crate) targets: Targets,
}

impl IntoProcess {
    /// Into this process's parent, which is asked for the targets through `targets`. From
    /// here on, this process is killed when its parent exits (strictly: the parent's thread
    /// that started it), so that nothing is written into a process that took the parent's
    /// pid.
    pub fn parent(targets: Targets) -> Self {
        // SAFETY: prctl with PR_SET_PDEATHSIG and a signal number only sets that signal.
        unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
        // After the prctl: a parent that exited before it is seen here (pid 1, or a
        // subreaper, which then never names itself).
        // SAFETY: getppid has no preconditions and cannot fail.
        let pid = unsafe { libc::getppid() };
        IntoProcess {
            pid,
            parent: true,
            targets,
        }
    }

    /// Into process `pid` (this one, in tests), checked before each write to be this
    /// process's parent when `parent` says so.
    #[cfg(test)]
    pub(crate) fn process(pid: i32, parent: bool, targets: Targets) -> Self {
        IntoProcess {
            pid,
            parent,
            targets,
        }
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }
}

/// The reader's answer for output `name` of `step`, one JSON line: `{"step", "name", "pid",
/// "targets": [[offset, length, address], ...]}` (`pid`: the reader's own process id), or
/// `"targets": null` to have the output written as a file. The step and name must be the
/// ones asked about.
pub fn parse_targets(line: &str, step: u64, name: &str) -> Result<Option<ReaderTargets>> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Answer {
        step: u64,
        name: String,
        #[serde(default)]
        pid: Option<i32>,
        targets: Option<Vec<Target>>,
    }
    let bad = |why: String| Error::InvalidInput(format!("the reader's targets for {name}: {why}"));
    let a: Answer = serde_json::from_str(line.trim_end()).map_err(|e| bad(e.to_string()))?;
    if a.step != step || a.name != name {
        return Err(bad(format!(
            "they are for {} of step {}, not for {name} of step {step}",
            a.name, a.step
        )));
    }
    let Some(ranges) = a.targets else {
        return Ok(None);
    };
    if ranges.len() > TARGETS_MAX {
        return Err(bad(format!("more than {TARGETS_MAX} ranges")));
    }
    let pid = a
        .pid
        .ok_or_else(|| bad("no pid: the reader names itself".into()))?;
    Ok(Some(ReaderTargets { pid, ranges }))
}

/// The targets a reader named for output `name`, sorted by offset and checked against the
/// output's data region `[start, end)` (after its length prefix and header): each must lie
/// in it, none may overlap another, none may be empty or at address 0, and none may wrap
/// around the address space.
pub fn check_targets(
    name: &str,
    mut targets: Vec<Target>,
    [start, end]: [u64; 2],
) -> Result<Vec<Target>> {
    targets.sort_unstable_by_key(|t| t.offset);
    let mut at = start;
    for t in &targets {
        let bad = |why: &str| {
            Error::InvalidInput(format!(
                "the reader's targets for {name}: [{}, {}, {:#x}] {why}",
                t.offset, t.len, t.addr
            ))
        };
        if t.len == 0 || t.addr == 0 {
            return Err(bad("is empty or at address 0"));
        }
        if t.offset < at {
            return Err(bad(&format!(
                "starts before byte {at} (inside the header or another range)"
            )));
        }
        if t.offset.checked_add(t.len).is_none_or(|e| e > end) {
            return Err(bad(&format!("ends past the data's end at byte {end}")));
        }
        if t.addr
            .checked_add(t.len)
            .is_none_or(|e| e > usize::MAX as u64)
        {
            return Err(bad("wraps around the address space"));
        }
        at = t.offset + t.len;
    }
    Ok(targets)
}

/// Where a read writes its output: files, or the reader's memory.
pub(crate) trait Output: Send + Sync {
    /// Writes `buf` at byte `offset` of output `out`.
    fn write_at(&self, out: usize, buf: &[u8], offset: u64) -> Result<()>;
}

impl Output for Vec<DurableFile> {
    fn write_at(&self, out: usize, buf: &[u8], offset: u64) -> Result<()> {
        self[out].write_at(buf, offset)
    }
}

/// A step's outputs in the reader's memory: each output's targets, sorted and checked.
#[derive(Debug)]
pub(crate) struct ProcessOut {
    pid: i32,
    parent: bool,
    outs: Vec<Vec<Target>>,
}

impl ProcessOut {
    /// Each output's targets, checked against the output ([`check_targets`]).
    pub(crate) fn new(
        into: &IntoProcess,
        outs: Vec<(String, Vec<Target>, [u64; 2])>,
    ) -> Result<Self> {
        let outs = outs
            .into_iter()
            .map(|(name, targets, data)| check_targets(&name, targets, data))
            .collect::<Result<_>>()?;
        Ok(ProcessOut {
            pid: into.pid,
            parent: into.parent,
            outs,
        })
    }

    /// Whether this process may write into the reader: reads the first byte of its first
    /// target and writes it back as it was. `Ok(false)` when the system denies it (the
    /// kernel's ptrace access check, which `kernel.yama.ptrace_scope` or a missing
    /// `PR_SET_PTRACER` may fail, or a seccomp filter: EPERM, EACCES, ENOSYS); any other
    /// failure (an address that is not the reader's memory) is an error.
    pub(crate) fn probe(&self) -> Result<bool> {
        let Some(t) = self.outs.iter().flatten().next() else {
            return Ok(true);
        };
        let mut byte = 0u8;
        let local = libc::iovec {
            iov_base: (&raw mut byte).cast(),
            iov_len: 1,
        };
        let remote = libc::iovec {
            iov_base: t.addr as usize as *mut libc::c_void,
            iov_len: 1,
        };
        // SAFETY: `local` is one byte of this frame's memory, written by the read and read by
        // the write; the remote side is another process's, which the kernel checks.
        let moved = unsafe {
            libc::process_vm_readv(self.pid, &local, 1, &remote, 1, 0) == 1
                && libc::process_vm_writev(self.pid, &local, 1, &remote, 1, 0) == 1
        };
        if moved {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EPERM | libc::EACCES | libc::ENOSYS) => {
                tracing::warn!(pid = self.pid, error = %e, "not allowed to write into the reader's memory; writing the state to a file instead");
                Ok(false)
            }
            _ => Err(Error::InvalidInput(format!(
                "the reader (process {}) named address {:#x} for bytes [{}, {}): {e}",
                self.pid,
                t.addr,
                t.offset,
                t.offset + t.len
            ))),
        }
    }
}

/// The pieces of a write of `len` bytes at `offset` of an output with `targets` (sorted,
/// apart): `(offset in the write, length, address)`, in order. Bytes that no target names
/// are not wanted.
fn pieces(targets: &[Target], offset: u64, len: u64) -> Vec<(u64, u64, u64)> {
    let end = offset + len;
    let mut i = targets.partition_point(|t| t.offset + t.len <= offset);
    let mut out = Vec::new();
    while let Some(t) = targets.get(i).filter(|t| t.offset < end) {
        let (a, b) = (offset.max(t.offset), end.min(t.offset + t.len));
        out.push((a - offset, b - a, t.addr + (a - t.offset)));
        i += 1;
    }
    out
}

impl Output for ProcessOut {
    fn write_at(&self, out: usize, buf: &[u8], offset: u64) -> Result<()> {
        // SAFETY: getppid has no preconditions.
        if self.parent && unsafe { libc::getppid() } != self.pid {
            return Err(Error::InvalidInput(format!(
                "the reader (process {}) is gone: nothing more is written",
                self.pid
            )));
        }
        let ps = pieces(&self.outs[out], offset, buf.len() as u64);
        for batch in ps.chunks(IOV_MAX) {
            let mut local = Vec::with_capacity(batch.len());
            let mut remote = Vec::with_capacity(batch.len());
            let mut want = 0usize;
            for &(at, n, addr) in batch {
                let piece = &buf[at as usize..(at + n) as usize];
                local.push(libc::iovec {
                    iov_base: piece.as_ptr() as *mut libc::c_void,
                    iov_len: piece.len(),
                });
                remote.push(libc::iovec {
                    iov_base: addr as usize as *mut libc::c_void,
                    iov_len: piece.len(),
                });
                want += piece.len();
            }
            // SAFETY: every local iovec is a slice of `buf`, which outlives the call and is
            // only read; the remote side is the reader's memory, which the kernel checks.
            let n = unsafe {
                libc::process_vm_writev(
                    self.pid,
                    local.as_ptr(),
                    local.len() as libc::c_ulong,
                    remote.as_ptr(),
                    remote.len() as libc::c_ulong,
                    0,
                )
            };
            if n < 0 || n as usize != want {
                let why = if n < 0 {
                    std::io::Error::last_os_error().to_string()
                } else {
                    format!("{n} of {want} bytes written")
                };
                let (first, last) = (batch[0], batch[batch.len() - 1]);
                return Err(Error::InvalidInput(format!(
                    "writing bytes [{}, {}) of output {out} into the reader (process {}) at {:#x}..{:#x}: {why}",
                    offset + first.0,
                    offset + last.0 + last.1,
                    self.pid,
                    first.2,
                    last.2 + last.1
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(offset: u64, len: u64, addr: u64) -> Target {
        Target { offset, len, addr }
    }

    #[test]
    fn a_write_goes_to_the_targets_it_overlaps_and_nowhere_else() {
        let ts = [t(100, 10, 0x1000), t(110, 5, 0x2000), t(130, 20, 0x3000)];
        // Spans the end of the first, the whole second, a gap, and the start of the third.
        assert_eq!(
            pieces(&ts, 105, 30),
            vec![(0, 5, 0x1005), (5, 5, 0x2000), (25, 5, 0x3000)]
        );
        // Inside a gap, and before and after all of them.
        assert!(pieces(&ts, 115, 15).is_empty());
        assert!(pieces(&ts, 0, 100).is_empty());
        assert!(pieces(&ts, 150, 1).is_empty());
        // Inside one.
        assert_eq!(pieces(&ts, 131, 2), vec![(0, 2, 0x3001)]);
    }

    /// A restore writes into its parent only while that is still its parent: here, a
    /// process that never was (this one) is refused before a byte moves.
    #[test]
    fn a_process_that_is_not_the_parent_is_not_written_into() {
        let mut buf = vec![0u8; 16];
        let me = std::process::id() as i32;
        let into = IntoProcess::process(me, true, Arc::new(|_, _| Ok(None)));
        let targets = vec![t(8, 16, buf.as_mut_ptr() as u64)];
        let out = ProcessOut::new(&into, vec![("f".into(), targets, [8, 24])]).unwrap();
        let e = out.write_at(0, &[7; 16], 8).unwrap_err().to_string();
        assert!(
            e.contains(&format!("process {me}")) && e.contains("gone"),
            "{e}"
        );
        assert_eq!(buf, [0; 16]);
        // The same, not checked for being the parent, is written.
        let into = IntoProcess::process(me, false, Arc::new(|_, _| Ok(None)));
        let targets = vec![t(8, 16, buf.as_mut_ptr() as u64)];
        let out = ProcessOut::new(&into, vec![("f".into(), targets, [8, 24])]).unwrap();
        out.write_at(0, &[7; 16], 8).unwrap();
        assert_eq!(buf, [7; 16]);
    }

    #[test]
    fn targets_outside_the_data_or_over_each_other_are_refused() {
        let into = IntoProcess::process(1, false, Arc::new(|_, _| Ok(None)));
        let check = |ts: Vec<Target>| ProcessOut::new(&into, vec![("f".into(), ts, [100, 200])]);
        assert!(check(vec![t(150, 50, 8), t(100, 50, 0x100)]).is_ok());
        for (ts, why) in [
            (vec![t(99, 2, 8)], "before byte 100"),
            (vec![t(190, 11, 8)], "past the data's end"),
            (vec![t(100, 10, 8), t(105, 10, 0x100)], "before byte 110"),
            (vec![t(100, 0, 8)], "empty"),
            (vec![t(100, 1, 0)], "address 0"),
            (vec![t(100, 10, u64::MAX - 4)], "wraps"),
            (vec![t(u64::MAX, 2, 8)], "past the data's end"),
        ] {
            let e = check(ts).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains("targets for f"), "{e}");
        }
    }

    #[test]
    fn an_answer_names_the_step_and_output_asked_about() {
        let ok = r#"{"step": 7, "name": "state.safetensors", "pid": 9, "targets": [[8, 4, 4096]]}"#;
        assert_eq!(
            parse_targets(ok, 7, "state.safetensors").unwrap(),
            Some(ReaderTargets {
                pid: 9,
                ranges: vec![t(8, 4, 4096)]
            })
        );
        let none = r#"{"step": 7, "name": "state.safetensors", "targets": null}"#;
        assert_eq!(parse_targets(none, 7, "state.safetensors").unwrap(), None);
        for (line, why) in [
            (ok.replace("7", "6"), "not for state.safetensors of step 7"),
            (
                ok.replace("state", "other"),
                "other.safetensors of step 7, not for state",
            ),
            (ok.replace(r#""pid": 9, "#, ""), "no pid"),
            (ok.replace("[[8, 4, 4096]]", "[[8, 4]]"), "expected"),
            (ok.replace("4096", "-1"), "invalid value"),
            (ok.replace("}", r#", "x": 1}"#), "unknown field"),
            ("{".into(), "EOF"),
        ] {
            let e = parse_targets(&line, 7, "state.safetensors")
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{line}: {e}");
        }
    }

    /// A step of one 1 MiB tensor in chunks of 256 KiB, committed to a `file://` store in
    /// raw chunks or compressed ones.
    async fn committed(compress: bool) -> (tempfile::TempDir, crate::Store, Vec<u8>) {
        use crate::save::{CommitRequest, PartInput, PartSource, SaveOptions};

        let root = tempfile::tempdir().unwrap();
        let store = crate::Store::open(&format!("file://{}", root.path().display())).unwrap();
        let data: Vec<u8> = (0..1u32 << 20)
            .map(|i| {
                if compress {
                    (i / 1000) as u8
                } else {
                    (i.wrapping_mul(2_654_435_761) >> 13) as u8
                }
            })
            .collect();
        let header = format!(
            r#"{{"t":{{"dtype":"U8","shape":[{n}],"data_offsets":[0,{n}]}}}}"#,
            n = data.len()
        );
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header.as_bytes());
        file.extend_from_slice(&data);
        let opts = SaveOptions {
            compress,
            chunk_bytes_max: 256 << 10,
            ..Default::default()
        };
        let input = PartInput {
            writer: "w".into(),
            source: PartSource::Buffers(vec![("f.safetensors".into(), file.into())]),
            shards: Default::default(),
        };
        let cancel = tokio_util::sync::CancellationToken::new();
        store.save_part(3, input, &opts, &cancel).await.unwrap();
        let req = CommitRequest {
            world_size: 1,
            writers: vec!["w".into()],
            metadata: serde_json::Value::Null,
        };
        store.commit(3, req, &cancel).await.unwrap();
        (root, store, data)
    }

    /// Restores step 3 into process `pid`'s memory at `addr`, as a reader (process
    /// `answer_pid`) that answers with the data region of the header it was sent: what the
    /// restore reported, and its events.
    async fn restore_into(
        store: &crate::Store,
        pid: i32,
        answer_pid: i32,
        addr: u64,
    ) -> Result<(super::super::RestoreReport, Vec<super::super::ReadEvent>)> {
        use super::super::{ReadEvent, ReadOptions};
        use std::sync::Mutex;

        let seen = Arc::new(Mutex::new(Vec::new()));
        let events: super::super::ReadEvents = {
            let seen = seen.clone();
            Arc::new(move |ev: &ReadEvent| seen.lock().unwrap().push(ev.clone()))
        };
        let targets: Targets = {
            let seen = seen.clone();
            Arc::new(move |step, name: &str| {
                let seen = seen.lock().unwrap();
                let Some(ReadEvent::Header {
                    step: s,
                    name: n,
                    bytes,
                    header,
                    targets: true,
                }) = seen.last()
                else {
                    panic!("asked for targets after {:?}", seen.last());
                };
                assert_eq!((*s, n.as_str()), (step, name));
                let start = 8 + header.len() as u64;
                Ok(Some(ReaderTargets {
                    pid: answer_pid,
                    ranges: vec![Target {
                        offset: start,
                        len: bytes - start,
                        addr,
                    }],
                }))
            })
        };
        let opts = ReadOptions {
            events: Some(events),
            into_process: Some(IntoProcess::process(pid, false, targets)),
            ..Default::default()
        };
        let dest = tempfile::tempdir().unwrap();
        let cancel = tokio_util::sync::CancellationToken::new();
        let report = store
            .restore(None, 0, 1, &dest.path().join("r"), &opts, &cancel)
            .await?;
        let names: Vec<_> = std::fs::read_dir(dest.path().join("r"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        let want = if report.written {
            vec![
                super::super::RESTORE_METADATA_FILE,
                super::super::RESTORE_FILE,
            ]
        } else {
            vec![super::super::RESTORE_METADATA_FILE]
        };
        let mut names = names;
        names.sort();
        assert_eq!(names, want);
        let seen = seen.lock().unwrap().clone();
        Ok((report, seen))
    }

    /// Raw and compressed chunks alike: the bytes land in the memory named, checked and whole,
    /// with no state file. A reader that is not the process written into (a wrapper between
    /// them) gets the file instead; a process that is gone is an error, and nothing is
    /// written.
    #[tokio::test]
    async fn a_restore_writes_the_state_into_the_memory_named_or_else_a_file() {
        use super::super::ReadEvent;

        for compress in [false, true] {
            let (_root, store, data) = committed(compress).await;
            let mut buf = vec![0u8; data.len()];
            let me = std::process::id() as i32;
            let (report, seen) = restore_into(&store, me, me, buf.as_mut_ptr() as u64)
                .await
                .unwrap();
            assert!(!report.written, "compress {compress}");
            assert!(buf == data, "compress {compress}: the bytes differ");
            let ready: u64 = seen
                .iter()
                .filter_map(|e| match e {
                    ReadEvent::Ready { ranges, .. } => {
                        Some(ranges.iter().map(|r| r[1]).sum::<u64>())
                    }
                    ReadEvent::File { .. } => panic!("a file event: {e:?}"),
                    _ => None,
                })
                .sum();
            assert_eq!(ready, data.len() as u64);

            // Another process answers: the file is written, and nothing into its memory.
            let mut other = vec![0u8; data.len()];
            let (report, seen) = restore_into(&store, me, me + 1, other.as_mut_ptr() as u64)
                .await
                .unwrap();
            assert!(report.written);
            assert!(other.iter().all(|&b| b == 0));
            assert!(seen.iter().any(|e| matches!(e, ReadEvent::File { .. })));
            // No such process: the probe fails, naming the address.
            let e = restore_into(&store, i32::MAX, i32::MAX, other.as_mut_ptr() as u64)
                .await
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("{:#x}", other.as_ptr() as u64)) && e.contains("process"),
                "{e}"
            );
        }
    }
}
