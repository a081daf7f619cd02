//! Durable local files: write to a temp file, fsync, rename, fsync the directory.
//!
//! Files are made 0600 and directories 0700, whatever the umask: they hold model weights.
//! [`DurableFile::create_under`] lays a relative name out under a root without following a
//! symlink anywhere below the root (each directory is opened with `O_NOFOLLOW` relative to
//! its parent, and the file is created and renamed relative to that directory), so a link
//! planted inside a destination can never send a write outside it.

use std::ffi::CString;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Mode of the files this crate writes locally.
pub const FILE_MODE: u32 = 0o600;
/// Mode of the directories this crate makes locally.
pub const DIR_MODE: u32 = 0o700;
/// Directory levels a relative name may have below its root.
const NAME_DEPTH_MAX: usize = 64;

/// Fsyncs a file and the directory that holds it.
pub fn fsync_file_and_dir(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| Error::io(path, e))?;
    if let Some(dir) = path.parent() {
        fsync_dir(dir)?;
    }
    Ok(())
}

/// Fsyncs a directory, so that the entries created, renamed or removed in it so far survive
/// a crash. Fails with [`Error::Io`] naming `dir`.
pub fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(dir, e))
}

/// Creates `dir` and its missing parents with mode 0700.
pub fn create_dir_private(dir: &Path) -> Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(dir)
        .map_err(|e| Error::io(dir, e))
}

fn cstr(path: &Path, s: &[u8]) -> Result<CString> {
    CString::new(s).map_err(|_| Error::InvalidInput(format!("{} contains NUL", path.display())))
}

/// Whether `name` inside `dir` is a symlink (without following it).
fn is_symlink_at(dir: &OwnedFd, name: &CString) -> bool {
    // SAFETY: an all-zero `stat` is a valid value for fstatat to fill.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd, NUL-terminated name and a writable stat buffer.
    let r = unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            name.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    r == 0 && (st.st_mode & libc::S_IFMT) == libc::S_IFLNK
}

/// Opens directory `name` inside `parent` without following a symlink, making it (0700) when
/// it is missing. Returns the directory and whether this call made it.
fn open_subdir(parent: &OwnedFd, name: &[u8], shown: &Path) -> Result<(OwnedFd, bool)> {
    let c = cstr(shown, name)?;
    // SAFETY: `c` is a valid NUL-terminated string and `parent` an open directory fd.
    let r = unsafe { libc::mkdirat(parent.as_raw_fd(), c.as_ptr(), DIR_MODE as libc::mode_t) };
    let made = r == 0;
    if r != 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::AlreadyExists {
            return Err(Error::io(shown, e));
        }
    }
    // SAFETY: as above; the returned fd is checked before it is owned.
    let fd = unsafe {
        libc::openat(
            parent.as_raw_fd(),
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        // With O_DIRECTORY, Linux answers ENOTDIR for a symlink too.
        return Err(match e.raw_os_error() {
            Some(libc::ELOOP | libc::ENOTDIR) if is_symlink_at(parent, &c) => {
                Error::InvalidInput(format!(
                    "{} is a symlink; refusing to write through it",
                    shown.display()
                ))
            }
            Some(libc::ENOTDIR) => Error::InvalidInput(format!(
                "{} is not a directory; a file of the checkpoint needs it to be one",
                shown.display()
            )),
            _ => Error::io(shown, e),
        });
    }
    // SAFETY: `fd` is a fresh, valid descriptor that nothing else owns.
    Ok((unsafe { OwnedFd::from_raw_fd(fd) }, made))
}

/// Whether a write may reach its root directory through a symlink standing at the root.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RootLink {
    /// The root may be a symlink to a directory (a `pull` into a linked directory).
    Follow,
    /// The root itself is opened without following a link: a symlink there is refused, even
    /// one planted after the caller checked the root.
    Refuse,
}

/// Checks that `dir` can take a fresh set of files: absent, or an empty directory that is not a
/// symlink. `what` names the directory's role in the message (`export target`).
pub fn check_fresh_dir(dir: &Path, what: &str) -> Result<()> {
    let meta = match std::fs::symlink_metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(dir, e)),
    };
    if meta.file_type().is_symlink() {
        return Err(Error::InvalidInput(format!(
            "{what} {} is a symlink; refusing to write through it",
            dir.display()
        )));
    }
    if !meta.is_dir() {
        return Err(Error::InvalidInput(format!(
            "{what} {} exists and is not a directory",
            dir.display()
        )));
    }
    let mut entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    if let Some(first) = entries.next() {
        let first = first.map_err(|e| Error::io(dir, e))?;
        return Err(Error::InvalidInput(format!(
            "{what} {} is not empty (it holds {:?}); nothing was written: use an empty or absent directory",
            dir.display(),
            first.file_name()
        )));
    }
    Ok(())
}

/// Bytes copied at a time where a chunk streams between a file and the store (a raw chunk read
/// from or written to a local directory, a chunk decoded into a restore's output): small enough
/// to stay in a core's cache between the read or decode, the checksum and the write.
pub(crate) const STREAM_BLOCK_BYTES: usize = 256 * 1024;

/// A file being written under a temp name next to its final name.
pub struct DurableFile {
    pub file: File,
    /// The directory that holds both names, opened without following links.
    dir: OwnedFd,
    tmp_name: CString,
    name: CString,
    tmp: PathBuf,
    dest: PathBuf,
    done: bool,
    /// Directories this file's creation made, outermost first.
    pub created_dirs: Vec<PathBuf>,
}

impl DurableFile {
    /// A file at `dest`, whose directory (and its parents) are made 0700 if missing.
    pub fn create(dest: &Path) -> Result<DurableFile> {
        let dir = dest
            .parent()
            .ok_or_else(|| Error::InvalidInput(format!("{} has no parent", dest.display())))?;
        let name = dest
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| Error::InvalidInput(format!("{} has no file name", dest.display())))?;
        create_dir_private(dir)?;
        Self::create_under(dir, name)
    }

    /// A file at `root/rel`, where `rel` is a relative name of `/`-separated components
    /// (checked by the caller against `..` and empty components). Directories below `root`
    /// are made 0700 when missing; a symlink or a non-directory on the way is refused, and so
    /// is a symlink at the final name.
    pub fn create_under(root: &Path, rel: &str) -> Result<DurableFile> {
        Self::create_in(root, rel, RootLink::Follow)
    }

    /// [`DurableFile::create_under`], with `root_link` saying whether `root` itself may be a
    /// symlink.
    pub fn create_in(root: &Path, rel: &str, root_link: RootLink) -> Result<DurableFile> {
        let dest = root.join(rel);
        let mut parts: Vec<&str> = rel.split('/').collect();
        let name = parts.pop().unwrap_or_default();
        if name.is_empty()
            || parts.len() > NAME_DEPTH_MAX
            || rel
                .split('/')
                .any(|c| c.is_empty() || c == "." || c == "..")
        {
            return Err(Error::InvalidName {
                name: rel.to_string(),
                reason: "not a relative path of plain components".into(),
            });
        }
        let nofollow = match root_link {
            RootLink::Follow => 0,
            RootLink::Refuse => libc::O_NOFOLLOW,
        };
        let root_file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC | nofollow)
            .open(root)
            .map_err(|e| match e.raw_os_error() {
                // With O_DIRECTORY, Linux answers ENOTDIR for a symlink too.
                Some(libc::ELOOP | libc::ENOTDIR)
                    if root_link == RootLink::Refuse
                        && std::fs::symlink_metadata(root)
                            .is_ok_and(|m| m.file_type().is_symlink()) =>
                {
                    Error::InvalidInput(format!(
                        "{} is a symlink; refusing to write through it",
                        root.display()
                    ))
                }
                _ => Error::io(root, e),
            })?;
        let mut dir = OwnedFd::from(root_file);
        let mut shown = root.to_path_buf();
        let mut created_dirs = Vec::new();
        for p in parts {
            shown.push(p);
            let (d, made) = open_subdir(&dir, p.as_bytes(), &shown)?;
            dir = d;
            if made {
                created_dirs.push(shown.clone());
            }
        }
        let tmp_text = format!(".{name}.tmp-{:016x}", rand::random::<u64>());
        let tmp_name = cstr(&dest, tmp_text.as_bytes())?;
        let name_c = cstr(&dest, name.as_bytes())?;
        let tmp = dest.with_file_name(&tmp_text);
        // SAFETY: valid NUL-terminated name relative to an open directory fd.
        let fd = unsafe {
            libc::openat(
                dir.as_raw_fd(),
                tmp_name.as_ptr(),
                libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                FILE_MODE as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(Error::io(&tmp, std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a fresh, valid descriptor that nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        Ok(DurableFile {
            file,
            dir,
            tmp_name,
            name: name_c,
            tmp,
            dest,
            done: false,
            created_dirs,
        })
    }

    /// The temporary name the file is written under until [`DurableFile::commit`].
    pub fn tmp_path(&self) -> &Path {
        &self.tmp
    }

    pub fn set_len(&self, len: u64) -> Result<()> {
        self.file.set_len(len).map_err(|e| Error::io(&self.tmp, e))
    }

    pub fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        use std::os::unix::fs::FileExt;
        self.file
            .write_all_at(buf, offset)
            .map_err(|e| Error::io(&self.tmp, e))
    }

    /// Fsyncs, renames over the destination and fsyncs the directory. A symlink standing at
    /// the destination is refused rather than replaced.
    pub fn commit(self) -> Result<()> {
        self.commit_as(true)
    }

    /// [`DurableFile::commit`], without the two fsyncs when `sync` is false: the file appears
    /// whole under its name, but a crash may lose it (for a file read once and removed).
    pub fn commit_as(mut self, sync: bool) -> Result<()> {
        self.file.flush().map_err(|e| Error::io(&self.tmp, e))?;
        if sync {
            self.file.sync_all().map_err(|e| Error::io(&self.tmp, e))?;
        }
        if is_symlink_at(&self.dir, &self.name) {
            return Err(Error::InvalidInput(format!(
                "{} is a symlink; refusing to replace it",
                self.dest.display()
            )));
        }
        // SAFETY: both names are NUL-terminated and relative to the same open directory.
        let r = unsafe {
            libc::renameat(
                self.dir.as_raw_fd(),
                self.tmp_name.as_ptr(),
                self.dir.as_raw_fd(),
                self.name.as_ptr(),
            )
        };
        if r != 0 {
            return Err(Error::io(&self.dest, std::io::Error::last_os_error()));
        }
        self.done = true;
        // SAFETY: valid open directory fd.
        if sync && unsafe { libc::fsync(self.dir.as_raw_fd()) } != 0 {
            return Err(Error::io(&self.dest, std::io::Error::last_os_error()));
        }
        Ok(())
    }
}

impl Drop for DurableFile {
    fn drop(&mut self) {
        if !self.done {
            // SAFETY: valid fd and NUL-terminated name; failure only leaves a temp file.
            unsafe { libc::unlinkat(self.dir.as_raw_fd(), self.tmp_name.as_ptr(), 0) };
        }
    }
}

/// Writes `data` to `dest` durably: into a fresh temp file (mode 0600, a random name next to
/// `dest`, created exclusively without following links), fsynced, renamed over `dest`, and
/// the directory fsynced. Readers see the old file or the whole new one, never a part. Missing
/// parent directories are made (0700; existing ones are left as they are); a symlink standing
/// at `dest` is refused rather than replaced. A failure before the rename removes the temp
/// file and leaves `dest` as it was. Fails with [`Error::Io`] naming the path, or with
/// [`Error::InvalidInput`] for a symlink at `dest` or a path without a parent or a UTF-8 file
/// name.
pub fn write_file_durable(dest: &Path, data: &[u8]) -> Result<()> {
    let f = DurableFile::create(dest)?;
    f.write_at(data, 0)?;
    f.commit()
}

/// Opens `path` for reading only if it is a regular file, without following a symlink at
/// its last component and without blocking on a FIFO (which a plain open would, forever).
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{} is a symlink, not a regular file", path.display()),
                )
            } else {
                e
            }
        })?;
    let ft = f.metadata()?.file_type();
    if !ft.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{} is not a regular file", path.display()),
        ));
    }
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn files_are_private_whatever_the_umask() {
        let tmp = tempfile::tempdir().unwrap();
        write_file_durable(&tmp.path().join("a/b/f.bin"), b"x").unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&tmp.path().join("a/b/f.bin")), FILE_MODE);
        assert_eq!(mode(&tmp.path().join("a/b")), DIR_MODE);
        let f = DurableFile::create_under(tmp.path(), "c/d/g.bin").unwrap();
        f.write_at(b"y", 0).unwrap();
        f.commit().unwrap();
        assert_eq!(mode(&tmp.path().join("c/d/g.bin")), FILE_MODE);
        assert_eq!(mode(&tmp.path().join("c")), DIR_MODE);
    }

    #[test]
    fn a_symlinked_directory_inside_the_root_is_never_written_through() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tmp.path().join("outside");
        let root = tmp.path().join("root");
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::create_dir_all(&root).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("sub")).unwrap();
        let e = DurableFile::create_under(&root, "sub/f.bin")
            .err()
            .expect("refused");
        assert!(e.to_string().contains("symlink"), "{e}");
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
    }

    #[test]
    fn a_symlinked_root_is_refused_when_asked_and_a_fresh_dir_must_be_empty() {
        let tmp = tempfile::tempdir().unwrap();
        let real = tmp.path().join("real");
        std::fs::create_dir(&real).unwrap();
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let e = DurableFile::create_in(&link, "f.bin", RootLink::Refuse)
            .err()
            .expect("refused");
        assert!(e.to_string().contains("is a symlink"), "{e}");
        assert_eq!(std::fs::read_dir(&real).unwrap().count(), 0);
        // Following it stays possible for callers that allow it.
        DurableFile::create_in(&link, "f.bin", RootLink::Follow)
            .unwrap()
            .commit()
            .unwrap();
        assert!(real.join("f.bin").exists());

        let e = check_fresh_dir(&link, "export target").unwrap_err();
        assert!(
            e.to_string().contains("export target") && e.to_string().contains("symlink"),
            "{e}"
        );
        let e = check_fresh_dir(&real, "export target").unwrap_err();
        assert!(
            e.to_string().contains("is not empty") && e.to_string().contains("f.bin"),
            "{e}"
        );
        let e = check_fresh_dir(&real.join("f.bin"), "export target").unwrap_err();
        assert!(e.to_string().contains("not a directory"), "{e}");
        check_fresh_dir(&tmp.path().join("absent"), "export target").unwrap();
        let empty = tmp.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        check_fresh_dir(&empty, "export target").unwrap();
    }

    #[test]
    fn a_symlink_at_the_final_name_is_not_replaced() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("target.bin");
        std::fs::write(&target, b"keep").unwrap();
        std::os::unix::fs::symlink(&target, tmp.path().join("f.bin")).unwrap();
        let f = DurableFile::create_under(tmp.path(), "f.bin").unwrap();
        f.write_at(b"new", 0).unwrap();
        let e = f.commit().unwrap_err();
        assert!(e.to_string().contains("symlink"), "{e}");
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        // No temp file is left behind.
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 2);
    }

    #[test]
    fn a_file_where_a_directory_belongs_is_a_clear_error() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("model.safetensors"), b"x").unwrap();
        let e = DurableFile::create_under(tmp.path(), "model.safetensors/inner.safetensors")
            .err()
            .expect("refused");
        assert!(e.to_string().contains("not a directory"), "{e}");
    }

    #[test]
    fn fifos_and_symlinks_are_not_opened_as_files() {
        let tmp = tempfile::tempdir().unwrap();
        let fifo = tmp.path().join("manifest.json");
        let c = CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: valid path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = open_regular(&fifo).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        std::fs::write(tmp.path().join("real"), b"x").unwrap();
        std::os::unix::fs::symlink(tmp.path().join("real"), tmp.path().join("link")).unwrap();
        assert!(open_regular(&tmp.path().join("link")).is_err());
        assert!(open_regular(&tmp.path().join("real")).is_ok());
    }
}
