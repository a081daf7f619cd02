//! Durable local files: write to a temp file, fsync, rename, fsync the directory.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use crate::error::{Error, Result};

/// Fsyncs a file and the directory that holds it.
pub fn fsync_file_and_dir(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| Error::io(path, e))?;
    if let Some(dir) = path.parent() {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| Error::io(dir, e))?;
    }
    Ok(())
}

/// A file being written under a temp name next to its final name.
pub struct DurableFile {
    pub file: File,
    tmp: std::path::PathBuf,
    dest: std::path::PathBuf,
    done: bool,
}

impl DurableFile {
    pub fn create(dest: &Path) -> Result<DurableFile> {
        let dir = dest
            .parent()
            .ok_or_else(|| Error::InvalidInput(format!("{} has no parent", dest.display())))?;
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let name = dest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = dir.join(format!(".{name}.tmp-{:016x}", rand::random::<u64>()));
        let file = File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        Ok(DurableFile {
            file,
            tmp,
            dest: dest.to_path_buf(),
            done: false,
        })
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

    /// Fsyncs, renames over the destination and fsyncs the directory.
    pub fn commit(mut self) -> Result<()> {
        self.file.flush().map_err(|e| Error::io(&self.tmp, e))?;
        self.file.sync_all().map_err(|e| Error::io(&self.tmp, e))?;
        std::fs::rename(&self.tmp, &self.dest).map_err(|e| Error::io(&self.dest, e))?;
        self.done = true;
        fsync_file_and_dir(&self.dest)
    }
}

impl Drop for DurableFile {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Writes `data` to `dest` durably.
pub fn write_durable(dest: &Path, data: &[u8]) -> Result<()> {
    let f = DurableFile::create(dest)?;
    f.write_at(data, 0)?;
    f.commit()
}
