//! The tmpfs mounts a run puts under nodes' staging (full-staging faults), unmounted when the
//! run ends.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Unmounts the staging tmpfs mounts of a run when dropped (also on early errors).
#[derive(Default)]
pub(super) struct Mounts(Vec<PathBuf>);

impl Mounts {
    /// Mounts a `size_mb` tmpfs on `dir`. Needs root; `Err` says why it did not happen.
    pub(super) fn tmpfs(&mut self, dir: &Path, size_mb: u64) -> std::result::Result<(), String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not root: cannot mount a tmpfs".into());
        }
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o"])
            .arg(format!("size={size_mb}m,mode=0755"))
            .arg("tmpfs")
            .arg(dir)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("mount: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mount tmpfs on {}: {}",
                dir.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        self.0.push(dir.to_path_buf());
        Ok(())
    }
}

impl Drop for Mounts {
    fn drop(&mut self) {
        for dir in self.0.drain(..).rev() {
            // Lazy: a process still holding a file there must not keep the mount forever.
            let _ = Command::new("umount")
                .arg("-l")
                .arg(&dir)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}
