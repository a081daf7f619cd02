//! Reading a part's input and planning its chunks: the directory walk, the safetensors
//! headers (checked before a byte is uploaded) and the cut of each file's data region into
//! chunks.

use std::path::{Path, PathBuf};

use bytes::Bytes;

use crate::error::{Error, Result};
use crate::format;
use crate::header::{self, Header};

/// Where one input file's bytes are.
#[derive(Debug, Clone)]
pub(super) enum Src {
    File(PathBuf),
    Buf(Bytes),
}

impl Src {
    pub(super) fn len(&self) -> Result<u64> {
        match self {
            Src::File(p) => std::fs::metadata(p)
                .map(|m| m.len())
                .map_err(|e| Error::io(p, e)),
            Src::Buf(b) => Ok(b.len() as u64),
        }
    }

    /// Hands `len` bytes from `offset` to `sink` in blocks of at most `block_bytes`, in order
    /// (`sink(position in the range, bytes)`): a file through one reused buffer, a buffer in
    /// place. Memory: one block.
    pub(super) fn read_blocks(
        &self,
        offset: u64,
        len: u64,
        block_bytes: usize,
        mut sink: impl FnMut(u64, &[u8]) -> Result<()>,
    ) -> Result<()> {
        match self {
            Src::File(p) => {
                use std::os::unix::fs::FileExt;
                let f = std::fs::File::open(p).map_err(|e| Error::io(p, e))?;
                let mut buf = vec![0u8; (len.min(block_bytes as u64) as usize).max(1)];
                let mut at = 0u64;
                while at < len {
                    let n = (len - at).min(buf.len() as u64) as usize;
                    f.read_exact_at(&mut buf[..n], offset + at)
                        .map_err(|e| Error::io(p, e))?;
                    sink(at, &buf[..n])?;
                    at += n as u64;
                }
                Ok(())
            }
            Src::Buf(b) => {
                let start = usize::try_from(offset).unwrap_or(usize::MAX);
                let end = start.saturating_add(usize::try_from(len).unwrap_or(usize::MAX));
                let bytes = b
                    .get(start..end)
                    .ok_or_else(|| Error::InvalidInput("buffer read out of bounds".into()))?;
                for (i, block) in bytes.chunks(block_bytes.max(1)).enumerate() {
                    sink((i * block_bytes.max(1)) as u64, block)?;
                }
                Ok(())
            }
        }
    }

    pub(super) fn read_at(&self, offset: u64, len: usize) -> Result<Vec<u8>> {
        match self {
            Src::File(p) => {
                use std::os::unix::fs::FileExt;
                let f = std::fs::File::open(p).map_err(|e| Error::io(p, e))?;
                let mut buf = vec![0u8; len];
                f.read_exact_at(&mut buf, offset)
                    .map_err(|e| Error::io(p, e))?;
                Ok(buf)
            }
            Src::Buf(b) => {
                let start = usize::try_from(offset).unwrap_or(usize::MAX);
                b.get(start..start.saturating_add(len))
                    .map(<[u8]>::to_vec)
                    .ok_or_else(|| Error::InvalidInput("buffer read out of bounds".into()))
            }
        }
    }
}

pub(super) struct InputFile {
    pub(super) name: String,
    pub(super) src: Src,
    pub(super) header_text: String,
    pub(super) header: Header,
    /// Where the data region starts in the file.
    pub(super) data_start: u64,
}

pub(super) fn open_input(name: String, src: Src) -> Result<InputFile> {
    format::validate_rel_name(&name).map_err(|reason| Error::InvalidName {
        name: name.clone(),
        reason,
    })?;
    let file_bytes = src.len()?;
    if file_bytes < 8 {
        return Err(Error::InvalidSafetensors {
            file: name,
            reason: format!("{file_bytes} bytes is shorter than the length prefix"),
        });
    }
    let prefix: [u8; 8] = src.read_at(0, 8)?.try_into().expect("8 bytes read");
    let n = header::header_len(prefix, &name, file_bytes)?;
    let text_bytes = src.read_at(8, n as usize)?;
    let header = header::parse_header(&text_bytes, &name)?;
    let data_start = 8 + n;
    // Checked: data offsets come from outside and may sum past u64 (`[0, 2^64-1]`).
    let described = data_start.checked_add(header.data_bytes);
    if described != Some(file_bytes) {
        return Err(Error::InvalidSafetensors {
            file: name,
            reason: match described {
                Some(d) => format!("file has {file_bytes} bytes but its header describes {d}"),
                None => {
                    format!("file has {file_bytes} bytes but its header describes more than 2^64")
                }
            },
        });
    }
    for t in &header.tensors {
        format::validate_rel_name(&t.name).map_err(|reason| Error::InvalidName {
            name: t.name.clone(),
            reason: format!("tensor in file {name}: {reason}"),
        })?;
    }
    let header_text = String::from_utf8(text_bytes).expect("parse_header checked UTF-8");
    Ok(InputFile {
        name,
        src,
        header_text,
        header,
        data_start,
    })
}

/// Every `*.safetensors` regular file under `root`, by relative name. The rule for links and
/// special files: a directory's symlinks are never followed, and an entry named
/// `*.safetensors` that is not a regular file (a symlink, a FIFO, a socket, a device) is
/// refused by name, so what is pushed is exactly what the directory holds. Other entries are
/// ignored. A directory with no `*.safetensors` file at all is refused too: an empty push
/// would become the newest step and hide every older one from `pull`.
pub(super) fn collect_dir(root: &Path) -> Result<Vec<(String, PathBuf)>> {
    /// Bounds the walk (symlink loops are not followed, but depth is bounded anyway).
    const DEPTH_MAX: usize = 32;
    /// Bounds the entries looked at.
    const ENTRIES_MAX: usize = 1_000_000;
    let mut seen = 0usize;
    let mut out = Vec::new();
    let mut stack = vec![(root.to_path_buf(), 0usize)];
    while let Some((dir, depth)) = stack.pop() {
        for entry in std::fs::read_dir(&dir).map_err(|e| Error::io(&dir, e))? {
            let entry = entry.map_err(|e| Error::io(&dir, e))?;
            seen += 1;
            if seen > ENTRIES_MAX {
                return Err(Error::InvalidInput(format!(
                    "{} holds over {ENTRIES_MAX} entries",
                    root.display()
                )));
            }
            let path = entry.path();
            // `file_type` does not follow symlinks.
            let ft = entry.file_type().map_err(|e| Error::io(&path, e))?;
            let named_safetensors = path.extension().is_some_and(|e| e == "safetensors");
            if named_safetensors && !ft.is_file() && !ft.is_dir() {
                let what = if ft.is_symlink() {
                    "a symlink"
                } else {
                    "not a regular file"
                };
                return Err(Error::InvalidInput(format!(
                    "{} is {what}; push reads regular files only (copy the file in instead)",
                    path.display()
                )));
            }
            if ft.is_dir() {
                if depth + 1 > DEPTH_MAX {
                    return Err(Error::InvalidInput(format!(
                        "{} is nested over {DEPTH_MAX} levels",
                        path.display()
                    )));
                }
                stack.push((path, depth + 1));
            } else if ft.is_file() && named_safetensors {
                let rel = path.strip_prefix(root).expect("walked under root");
                let name = rel
                    .to_str()
                    .ok_or_else(|| Error::InvalidName {
                        name: rel.to_string_lossy().into_owned(),
                        reason: "not UTF-8".into(),
                    })?
                    .to_string();
                out.push((name, path));
            }
        }
    }
    if out.is_empty() {
        return Err(Error::InvalidInput(format!(
            "{} holds no *.safetensors file; refusing to save an empty part",
            root.display()
        )));
    }
    out.sort();
    Ok(out)
}

#[derive(Debug, Clone)]
pub(super) struct ChunkPlan {
    pub(super) file: usize,
    /// Range in the file's data region.
    pub(super) start: u64,
    pub(super) len: u64,
    pub(super) width: Option<u8>,
}

/// Cuts a file's data region into chunks of at most `max` bytes: small tensors are packed
/// together, a big tensor is split at element boundaries.
pub(super) fn plan_chunks(file: usize, h: &Header, max: u64, out: &mut Vec<ChunkPlan>) {
    // Bytes per plane width (index 0: none, 1: 2, 2: 4, 3: 8) in the chunk being built.
    let mut widths = [0u64; 4];
    let mut cur_start = 0u64;
    let mut cur_len = 0u64;
    let slot = |w: Option<u8>| match w {
        Some(2) => 1,
        Some(4) => 2,
        Some(8) => 3,
        _ => 0,
    };
    let flush = |out: &mut Vec<ChunkPlan>, start: u64, len: u64, widths: &mut [u64; 4]| {
        if len == 0 {
            return;
        }
        let (best, bytes) = widths
            .iter()
            .enumerate()
            .max_by_key(|(_, b)| **b)
            .map(|(i, b)| (i, *b))
            .unwrap_or((0, 0));
        let width = (bytes * 2 > len)
            .then_some([0u8, 2, 4, 8][best])
            .filter(|w| *w > 0);
        out.push(ChunkPlan {
            file,
            start,
            len,
            width,
        });
        *widths = [0; 4];
    };
    for t in &h.tensors {
        let tb = t.data_offsets[1] - t.data_offsets[0];
        if tb == 0 {
            continue;
        }
        let w = header::plane_width_for(&t.dtype);
        if cur_len + tb <= max {
            if cur_len == 0 {
                cur_start = t.data_offsets[0];
            }
            cur_len += tb;
            widths[slot(w)] += tb;
            continue;
        }
        flush(out, cur_start, cur_len, &mut widths);
        let elem = header::dtype_size_bytes(&t.dtype).unwrap_or(1);
        let piece = (max - max % elem).max(elem);
        let mut start = t.data_offsets[0];
        let mut rest = tb;
        while rest > max {
            widths[slot(w)] = piece;
            flush(out, start, piece, &mut widths);
            start += piece;
            rest -= piece;
        }
        cur_start = start;
        cur_len = rest;
        widths[slot(w)] = rest;
    }
    flush(out, cur_start, cur_len, &mut widths);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header_of(tensors: &[(&str, &str, u64)]) -> Header {
        let mut off = 0;
        let mut h = Header::default();
        for (name, dtype, bytes) in tensors {
            let elem = header::dtype_size_bytes(dtype).unwrap();
            h.tensors.push(header::HeaderTensor {
                name: name.to_string(),
                dtype: dtype.to_string(),
                shape: vec![bytes / elem],
                data_offsets: [off, off + bytes],
            });
            off += bytes;
        }
        h.data_bytes = off;
        h
    }

    #[test]
    fn chunks_pack_small_tensors_split_big_ones_and_cover_the_data_exactly() {
        let h = header_of(&[
            ("a", "F32", 40),
            ("b", "F32", 40),
            ("big", "BF16", 250),
            ("c", "U8", 3),
            ("d", "F32", 100),
        ]);
        let mut plans = Vec::new();
        plan_chunks(0, &h, 100, &mut plans);
        let mut pos = 0;
        for p in &plans {
            assert_eq!(p.start, pos, "{plans:?}");
            assert!(p.len <= 100 && p.len > 0);
            pos += p.len;
        }
        assert_eq!(pos, h.data_bytes);
        assert_eq!(plans[0].len, 80, "a and b packed: {plans:?}");
        assert_eq!(plans[0].width, Some(4));
        assert_eq!(plans[1].width, Some(2));
    }
}
