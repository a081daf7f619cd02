//! Injecting one fault: signals to agents and workers, notices, partitions and black holes,
//! store trouble through the fault proxy, etcd restarts, full staging filesystems.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context, Result};

use super::nodes::Run;
use super::procs::{ProcId, signal, workers};
use crate::proxy::Mode;
use crate::scenario::{Fault, FaultKind};

/// The file that fills a full staging filesystem.
const FILL_FILE: &str = ".elastic-chaos-fill";
/// Bytes written per call while filling.
const FILL_CHUNK_BYTES: usize = 1 << 20;

/// Fills the filesystem of `dir` (a tmpfs of `size_mb`) with one file; returns its bytes.
fn fill(dir: &Path, size_mb: u64) -> std::io::Result<u64> {
    use std::io::Write;
    let mut f = std::fs::File::create(dir.join(FILL_FILE))?;
    let chunk = vec![0u8; FILL_CHUNK_BYTES];
    let mut written = 0u64;
    // Bounded: one more chunk than the filesystem can hold; then the rest below a chunk in
    // ever smaller writes, down to a block.
    let mut len = FILL_CHUNK_BYTES;
    for _ in 0..(size_mb + 64) {
        match f.write(&chunk[..len]) {
            Ok(n) if n > 0 => written += n as u64,
            Ok(_) => break,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                len /= 2;
                if len < 4096 {
                    break;
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(written)
}

impl Run<'_> {
    /// Injects `f`; `Ok(Some(why))` when it could not be (it is then reported, not judged).
    pub(super) async fn inject(&mut self, f: &Fault) -> Result<Option<String>> {
        tracing::warn!(kind = ?f.kind, node = f.node, "injecting fault");
        let dur = Duration::from_millis(f.duration_ms);
        match f.kind {
            FaultKind::Join => {
                let idx = self.nodes.len();
                self.start_node(idx).await?;
                return Ok(None);
            }
            FaultKind::EtcdRestart => {
                let etcd = self.etcd.clone();
                etcd.lock().expect("etcd lock").kill();
                // On a thread of its own that lives until the run ends: services die with the
                // thread that started them (PR_SET_PDEATHSIG), and neither blocking-pool
                // threads nor a worker thread given up by `block_in_place` are sure to last.
                let (keep_tx, keep_rx) = std::sync::mpsc::channel::<()>();
                self.keepers.push(keep_tx);
                std::thread::spawn(move || {
                    std::thread::sleep(dur);
                    let r = etcd.lock().expect("etcd lock").restart();
                    if r.is_err() {
                        tracing::error!("etcd did not come back: {r:?}");
                    }
                    // Returns when the run drops its end.
                    let _ = keep_rx.recv();
                });
                return Ok(None);
            }
            FaultKind::StoreOutage | FaultKind::StoreSlow | FaultKind::StoreErrors => {
                let Some(p) = &self.store_proxy else {
                    return Ok(Some("store faults need store = \"s3\"".into()));
                };
                let mode = match f.kind {
                    FaultKind::StoreOutage => Mode::Down,
                    FaultKind::StoreSlow => Mode::Slow {
                        delay_ms: f.delay_ms,
                    },
                    _ => Mode::Http503,
                };
                p.fault_for(mode, dur);
                return Ok(None);
            }
            _ => {}
        }
        let Some(n) = self.nodes.get_mut(f.node) else {
            return Ok(Some(format!(
                "no node {} (the run has {})",
                f.node,
                self.nodes.len()
            )));
        };
        let Some(agent) = n.child.as_mut() else {
            return Ok(Some(format!("{} has no agent", n.name)));
        };
        if !matches!(agent.try_wait(), Ok(None)) {
            return Ok(Some(format!("{}'s agent has already exited", n.name)));
        }
        let pid = agent.id() as i32;
        match f.kind {
            FaultKind::SigkillAgent => {
                n.removed = true;
                signal(pid, libc::SIGKILL);
            }
            FaultKind::SigtermAgent => {
                n.removed = true;
                signal(pid, libc::SIGTERM);
            }
            FaultKind::Notice => {
                n.removed = true;
                n.notice.store(true, Ordering::SeqCst);
                tracing::info!(url = %n.notice_url, "notice served");
            }
            FaultKind::SigkillWorker | FaultKind::SigstopWorker => {
                let script = self.tools.example.to_string_lossy().into_owned();
                let Some(w) = workers(pid, &script).first().and_then(|p| ProcId::of(*p)) else {
                    return Ok(Some(format!("{} has no worker running", n.name)));
                };
                if f.kind == FaultKind::SigkillWorker {
                    w.signal(libc::SIGKILL);
                } else {
                    w.signal(libc::SIGSTOP);
                    tokio::spawn(async move {
                        tokio::time::sleep(dur).await;
                        // The agent's hang watchdog has probably killed it meanwhile.
                        w.signal(libc::SIGCONT);
                    });
                }
            }
            FaultKind::Partition | FaultKind::Blackhole => {
                let mode = if f.kind == FaultKind::Partition {
                    Mode::Down
                } else {
                    Mode::Blackhole
                };
                n.etcd_proxy.fault_for(mode, dur);
                if let Some(fwd) = &n.store_fwd {
                    fwd.fault_for(mode, dur);
                }
                if let Some(link) = self.net.as_ref().and_then(|net| net.link_switch(f.node)) {
                    // Packets to and from the peers are dropped: their collectives with this
                    // node stall until the agents re-form without it.
                    link.set(false)?;
                    tracing::info!(node = %n.name, "link down");
                    tokio::spawn(async move {
                        tokio::time::sleep(dur).await;
                        let r = tokio::task::spawn_blocking(move || link.set(true)).await;
                        if !matches!(r, Ok(Ok(()))) {
                            tracing::error!("link did not come back up: {r:?}");
                        }
                    });
                }
            }
            FaultKind::StagingFull => {
                let dir = n.staging.clone();
                if n.staging_mounted {
                    let size_mb = self.s.staging_mb;
                    let d = dir.clone();
                    let bytes = tokio::task::spawn_blocking(move || fill(&d, size_mb))
                        .await
                        .context("fill task")?
                        .with_context(|| format!("fill {}", dir.display()))?;
                    tracing::info!(node = %n.name, bytes, "staging filesystem full");
                    tokio::spawn(async move {
                        tokio::time::sleep(dur).await;
                        let _ = std::fs::remove_file(dir.join(FILL_FILE));
                    });
                } else {
                    // SAFETY: geteuid has no preconditions.
                    if unsafe { libc::geteuid() } == 0 {
                        return Ok(Some(
                            "no tmpfs could be mounted, and a read-only directory does not stop \
                             root"
                                .into(),
                        ));
                    }
                    // Not root: a read-only staging directory stands in for a full one (new
                    // step directories cannot be created; writes into existing ones still
                    // succeed).
                    tracing::warn!(node = %n.name, "staging_full simulated with a read-only directory");
                    set_mode(&dir, 0o555)?;
                    tokio::spawn(async move {
                        tokio::time::sleep(dur).await;
                        let _ = set_mode(&dir, 0o755);
                    });
                }
            }
            _ => unreachable!("handled above"),
        }
        Ok(None)
    }
}

fn set_mode(dir: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {mode:o} {}", dir.display()))
}
