//! Decoding a chunk while its stored bytes arrive: [`ChunkDecoder`] takes the stored bytes in
//! pieces of any size, in order, and hands the decoded bytes to a sink in order, in blocks of
//! at most a given size, each while it is still in cache. It computes the checksums on the way
//! (the stored bytes' as they arrive, the decoded bytes' as they leave), so each byte is
//! touched once by a checksum and once by the copy that puts it in place. A chunk whose
//! manifest lists block checksums has its decoded bytes summed by block instead
//! ([`ChunkDecoder::sum_blocks`]), and the whole chunk's decoded checksum is their
//! combination. Those sums cover every decoded byte, so they stand in for the stored bytes'
//! checksum too: a chunk summed by block is summed once, raw or compressed. Without block sums a
//! compressed chunk is summed twice, once as stored and once decoded (and with them when the
//! caller checks every checksum: [`ChunkDecoder::keep_stored_sum`]).
//!
//! - `raw`: each piece is handed on as it arrives; nothing is held.
//! - `zstd`: the frame is decompressed as it arrives, through one block of buffer.
//! - `zstd-planes`: compressed planes are decompressed as they arrive into one buffer per plane;
//!   raw planes and the tail are kept as the pieces that brought them (no copy). The elements are
//!   put back together only when the last plane is in, a block at a time. So memory holds the
//!   chunk's planes, as a whole-chunk decode would, and never the stored bytes twice.
//! - `zstd-blocks`: each block is decoded as soon as its stored bytes are in, so memory holds
//!   one block's stored and decoded bytes.

use bytes::Bytes;

use super::{BlockDecoder, BlocksError, Codec, block_raw_range, gather_planes};
use crate::format::BlockCrcs;

type Zstd = zstd::stream::raw::Decoder<'static>;

/// A chunk being decoded from its stored bytes as they arrive; see the module docs.
pub struct ChunkDecoder {
    raw_len: usize,
    stored_len: u64,
    block_bytes: usize,
    received: u64,
    stored_crc: u32,
    raw_crc: DecodedSum,
    /// Whether the stored bytes are summed even when the decoded ones are summed by block.
    stored_sum_kept: bool,
    emitted: u64,
    state: State,
}

/// The checksums a finished chunk had: what the caller checks against the manifest before it
/// trusts what the sink was given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checksums {
    /// The stored bytes' crc32c; `None` for a compressed chunk summed by block, whose stored
    /// bytes are not summed on their own (see [`ChunkDecoder::sum_blocks`]) unless asked
    /// ([`ChunkDecoder::keep_stored_sum`]).
    pub stored: Option<u32>,
    /// The decoded bytes' crc32c (with block sums, their combination).
    pub decoded: u32,
    /// The decoded bytes' crc32c per check block, when asked for.
    pub blocks: Option<Vec<u32>>,
}

/// The decoded bytes' checksum: whole, or per check block.
enum DecodedSum {
    Whole(u32),
    Blocks(BlockCrcs),
}

impl DecodedSum {
    fn add(&mut self, b: &[u8]) {
        match self {
            DecodedSum::Whole(c) => *c = crc32c::crc32c_append(*c, b),
            DecodedSum::Blocks(s) => s.push(b),
        }
    }

    fn finish(self) -> (u32, Option<Vec<u32>>) {
        match self {
            DecodedSum::Whole(c) => (c, None),
            DecodedSum::Blocks(s) => {
                let (c, blocks) = s.finish();
                (c, Some(blocks))
            }
        }
    }
}

enum State {
    Raw,
    Zstd {
        dec: Box<Zstd>,
        buf: Vec<u8>,
        filled: usize,
        frame_done: bool,
    },
    Planes {
        width: usize,
        plane_len: usize,
        /// `(compressed, stored bytes)` of each plane, in stored order.
        spans: Vec<(bool, u64)>,
        /// The plane whose stored bytes come next (`width` once all are in: the tail).
        cur: usize,
        left_in_span: u64,
        dec: Option<Box<Zstd>>,
        planes: Vec<Plane>,
        tail: Vec<Bytes>,
    },
    Blocks {
        /// The stored length of each block.
        sizes: Vec<u64>,
        /// The block whose stored bytes come next.
        cur: usize,
        /// Its stored bytes that have arrived, when they came in more than one piece.
        held: Vec<u8>,
        dec: Box<BlockDecoder>,
    },
}

enum Plane {
    Decoded {
        buf: Vec<u8>,
        filled: usize,
        frame_done: bool,
    },
    Pieces(Vec<Bytes>),
}

fn zstd_err(e: std::io::Error) -> String {
    format!("zstd: {e}")
}

fn ends_before(n: usize) -> String {
    format!("zstd frame ends before {n} bytes")
}

fn more_than(n: usize) -> String {
    format!("zstd frame decodes to more than {n} bytes")
}

/// Hands `b`, which starts `*emitted` bytes into the decoded chunk, to `sink`.
fn emit<E>(
    crc: &mut DecodedSum,
    emitted: &mut u64,
    sink: &mut impl FnMut(u64, &[u8]) -> Result<(), E>,
    b: &[u8],
) -> Result<(), BlocksError<E>> {
    if b.is_empty() {
        return Ok(());
    }
    crc.add(b);
    sink(*emitted, b).map_err(BlocksError::Sink)?;
    *emitted += b.len() as u64;
    Ok(())
}

/// Decompresses `input` into `out[*filled..]`, all of it, for a frame that must decode to
/// exactly `out.len()` bytes: output past that is an error.
fn feed_plane(
    dec: &mut Zstd,
    mut input: &[u8],
    out: &mut [u8],
    filled: &mut usize,
    frame_done: &mut bool,
) -> Result<(), String> {
    use zstd::stream::raw::Operation;
    let mut spare = [0u8; 1];
    loop {
        let full = *filled == out.len();
        let dst: &mut [u8] = if full {
            &mut spare
        } else {
            &mut out[*filled..]
        };
        let st = dec.run_on_buffers(input, dst).map_err(zstd_err)?;
        if full && st.bytes_written > 0 {
            return Err(more_than(out.len()));
        }
        *filled += st.bytes_written;
        // A call that moved nothing reports on the next frame, not this one.
        if st.bytes_read > 0 || st.bytes_written > 0 {
            *frame_done = st.remaining == 0;
        }
        input = &input[st.bytes_read..];
        // Done when the input is used up and nothing more came out (it may hold output back
        // while it has room to give, so ask again until it gives nothing).
        if st.bytes_read == 0 && st.bytes_written == 0 {
            if input.is_empty() {
                return Ok(());
            }
            return Err(format!(
                "zstd: {} stored bytes that decode to nothing",
                input.len()
            ));
        }
    }
}

/// The stored spans of a `zstd-planes` chunk, after `cur`, skipping empty ones: the next plane
/// that takes bytes, or `planes.len()` for the tail.
fn next_span(spans: &[(bool, u64)], mut cur: usize) -> usize {
    while cur < spans.len() && spans[cur].1 == 0 {
        cur += 1;
    }
    cur
}

impl ChunkDecoder {
    /// A decoder for a chunk stored as `codec` in `stored_len` bytes that decodes to
    /// `raw_bytes`, handing blocks of at most `block_bytes` (at least 8) to its sink. Refuses
    /// numbers that disagree before a byte arrives.
    pub fn new(
        codec: &Codec,
        raw_bytes: u64,
        stored_len: u64,
        block_bytes: usize,
    ) -> Result<Self, String> {
        codec.check(raw_bytes, stored_len)?;
        let raw_len =
            usize::try_from(raw_bytes).map_err(|_| "raw length does not fit in memory")?;
        let block_bytes = block_bytes.max(8);
        let state = match codec {
            Codec::Raw => State::Raw,
            Codec::Zstd => State::Zstd {
                dec: Box::new(Zstd::new().map_err(zstd_err)?),
                buf: vec![0u8; block_bytes.min(raw_len)],
                filled: 0,
                frame_done: false,
            },
            Codec::ZstdPlanes { width, planes } => {
                let w = usize::from(*width);
                let plane_len = raw_len / w;
                let spans: Vec<(bool, u64)> =
                    planes.iter().map(|p| (p.zstd, p.stored_bytes)).collect();
                let mut kept = Vec::with_capacity(w);
                for (zstd, _) in &spans {
                    kept.push(if *zstd {
                        Plane::Decoded {
                            buf: vec![0u8; plane_len],
                            filled: 0,
                            frame_done: false,
                        }
                    } else {
                        Plane::Pieces(Vec::new())
                    });
                }
                let mut s = State::Planes {
                    width: w,
                    plane_len,
                    cur: 0,
                    left_in_span: 0,
                    dec: None,
                    planes: kept,
                    tail: Vec::new(),
                    spans,
                };
                Self::enter_span(&mut s, 0)?;
                s
            }
            Codec::ZstdBlocks { width, blocks } => State::Blocks {
                sizes: blocks.clone(),
                cur: 0,
                held: Vec::new(),
                dec: Box::new(BlockDecoder::new(*width)?),
            },
        };
        Ok(Self {
            raw_len,
            stored_len,
            block_bytes,
            received: 0,
            stored_crc: 0,
            raw_crc: DecodedSum::Whole(0),
            stored_sum_kept: false,
            emitted: 0,
            state,
        })
    }

    /// Sums the decoded bytes per check block ([`crate::format::CHECK_BLOCK_BYTES`]), for a
    /// chunk whose manifest lists its block checksums, in place of the whole chunk's decoded
    /// sum: [`Checksums::decoded`] is then their combination. The stored bytes get no pass of
    /// their own: a raw chunk's stored bytes are its decoded bytes, so [`Checksums::stored`]
    /// is that combination too; a compressed chunk's is `None`, since decoded bytes that match
    /// every block's checksum are right whatever the stored bytes were. Call it before the
    /// first push.
    pub fn sum_blocks(&mut self) {
        debug_assert_eq!(self.received, 0, "sum_blocks after a push");
        self.raw_crc = DecodedSum::Blocks(BlockCrcs::default());
    }

    /// Keeps the stored bytes' own sum of a compressed chunk summed by block, for a caller that
    /// checks every checksum the manifest lists (`verify`): [`Checksums::stored`] is then
    /// `Some` for every chunk. Call it before the first push.
    pub fn keep_stored_sum(&mut self) {
        debug_assert_eq!(self.received, 0, "keep_stored_sum after a push");
        self.stored_sum_kept = true;
    }

    /// Whether the stored bytes are summed as they arrive: unless the decoded bytes are summed
    /// by block, which covers them (and, for a raw chunk, are the stored bytes' sum).
    fn sums_stored(&self) -> bool {
        match self.raw_crc {
            DecodedSum::Whole(_) => true,
            DecodedSum::Blocks(_) => self.stored_sum_kept && !matches!(self.state, State::Raw),
        }
    }

    /// Moves a `zstd-planes` state to the first span at or after `from` that has bytes.
    fn enter_span(s: &mut State, from: usize) -> Result<(), String> {
        let State::Planes {
            spans,
            cur,
            left_in_span,
            dec,
            ..
        } = s
        else {
            return Ok(());
        };
        *cur = next_span(spans, from);
        *left_in_span = spans.get(*cur).map_or(0, |s| s.1);
        *dec = match spans.get(*cur) {
            Some((true, _)) => Some(Box::new(Zstd::new().map_err(zstd_err)?)),
            _ => None,
        };
        Ok(())
    }

    /// Takes the next `piece` of stored bytes, of any size, handing on whatever it completes.
    /// A piece larger than a block is taken a block at a time, so that each part is checksummed
    /// and used while it is in cache.
    pub fn push<E>(
        &mut self,
        piece: Bytes,
        sink: &mut impl FnMut(u64, &[u8]) -> Result<(), E>,
    ) -> Result<(), BlocksError<E>> {
        if piece.len() as u64 > self.stored_len - self.received {
            return Err(BlocksError::Codec(format!(
                "more than the {} stored bytes arrived",
                self.stored_len
            )));
        }
        let mut at = 0;
        while at < piece.len() {
            let n = self.block_bytes.min(piece.len() - at);
            self.push_block(piece.slice(at..at + n), sink)?;
            at += n;
        }
        Ok(())
    }

    /// [`ChunkDecoder::push`] for a piece of at most one block.
    fn push_block<E>(
        &mut self,
        mut piece: Bytes,
        sink: &mut impl FnMut(u64, &[u8]) -> Result<(), E>,
    ) -> Result<(), BlocksError<E>> {
        let n = piece.len() as u64;
        self.received += n;
        let sums_stored = self.sums_stored();
        if sums_stored {
            self.stored_crc = crc32c::crc32c_append(self.stored_crc, &piece);
        }
        match &mut self.state {
            // Its decoded bytes are its stored bytes: summed once, whole as stored or by block
            // as decoded.
            State::Raw => {
                if sums_stored {
                    if n > 0 {
                        sink(self.emitted, &piece).map_err(BlocksError::Sink)?;
                        self.emitted += n;
                    }
                } else {
                    emit(&mut self.raw_crc, &mut self.emitted, sink, &piece)?;
                }
            }
            State::Zstd { .. } => self.feed_zstd(&piece, sink)?,
            State::Blocks {
                sizes,
                cur,
                held,
                dec,
            } => {
                while !piece.is_empty() {
                    let Some(&size) = sizes.get(*cur) else {
                        return Err(BlocksError::Codec(
                            "stored bytes past the last block".into(),
                        ));
                    };
                    let need = size as usize - held.len();
                    let part = piece.split_to(need.min(piece.len()));
                    let stored: &[u8] = if held.is_empty() && part.len() == need {
                        &part
                    } else {
                        held.extend_from_slice(&part);
                        if held.len() < size as usize {
                            continue;
                        }
                        held
                    };
                    let (a, b) = block_raw_range(self.raw_len as u64, *cur as u64);
                    let raw = dec
                        .decode(stored, (b - a) as usize)
                        .map_err(|e| BlocksError::Codec(format!("block {cur}: {e}")))?;
                    for out in raw.chunks(self.block_bytes) {
                        emit(&mut self.raw_crc, &mut self.emitted, sink, out)?;
                    }
                    held.clear();
                    *cur += 1;
                }
            }
            State::Planes { .. } => {
                while !piece.is_empty() {
                    let State::Planes {
                        cur,
                        left_in_span,
                        dec,
                        planes,
                        tail,
                        width,
                        ..
                    } = &mut self.state
                    else {
                        unreachable!("matched above")
                    };
                    if *cur >= *width {
                        tail.push(std::mem::take(&mut piece));
                        break;
                    }
                    let take = (*left_in_span).min(piece.len() as u64) as usize;
                    let part = piece.split_to(take);
                    match (&mut planes[*cur], dec.as_deref_mut()) {
                        (
                            Plane::Decoded {
                                buf,
                                filled,
                                frame_done,
                            },
                            Some(d),
                        ) => feed_plane(d, &part, buf, filled, frame_done)
                            .map_err(BlocksError::Codec)?,
                        (Plane::Pieces(v), _) => v.push(part),
                        (Plane::Decoded { .. }, None) => {
                            unreachable!("a compressed span always has a decoder")
                        }
                    }
                    *left_in_span -= take as u64;
                    if *left_in_span == 0 {
                        let k = *cur;
                        if let Plane::Decoded {
                            buf,
                            filled,
                            frame_done,
                        } = &planes[k]
                            && (*filled != buf.len() || !*frame_done)
                        {
                            return Err(BlocksError::Codec(ends_before(buf.len())));
                        }
                        Self::enter_span(&mut self.state, k + 1).map_err(BlocksError::Codec)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Feeds `input` to a `zstd` chunk's decoder (see [`ChunkDecoder::stream_zstd`]).
    fn feed_zstd<E>(
        &mut self,
        mut input: &[u8],
        sink: &mut impl FnMut(u64, &[u8]) -> Result<(), E>,
    ) -> Result<(), BlocksError<E>> {
        let State::Zstd {
            dec,
            buf,
            filled,
            frame_done,
        } = &mut self.state
        else {
            return Ok(());
        };
        Self::stream_zstd(
            dec,
            &mut input,
            buf,
            filled,
            frame_done,
            self.raw_len,
            &mut self.raw_crc,
            &mut self.emitted,
            sink,
        )
    }

    /// Streams `input` of a `zstd` chunk through `buf`, handing each full block on. Output
    /// past `raw_len` is an error.
    #[allow(clippy::too_many_arguments)]
    fn stream_zstd<E>(
        dec: &mut Zstd,
        input: &mut &[u8],
        buf: &mut [u8],
        filled: &mut usize,
        frame_done: &mut bool,
        raw_len: usize,
        raw_crc: &mut DecodedSum,
        emitted: &mut u64,
        sink: &mut impl FnMut(u64, &[u8]) -> Result<(), E>,
    ) -> Result<(), BlocksError<E>> {
        use zstd::stream::raw::Operation;
        let mut spare = [0u8; 1];
        loop {
            let left = raw_len as u64 - *emitted - *filled as u64;
            let full = left == 0;
            let dst: &mut [u8] = if full {
                &mut spare
            } else {
                let room = (buf.len() - *filled).min(left as usize);
                &mut buf[*filled..*filled + room]
            };
            let st = dec
                .run_on_buffers(input, dst)
                .map_err(|e| BlocksError::Codec(zstd_err(e)))?;
            if full && st.bytes_written > 0 {
                return Err(BlocksError::Codec(more_than(raw_len)));
            }
            *filled += st.bytes_written;
            // A call that moved nothing reports on the next frame, not this one.
            if st.bytes_read > 0 || st.bytes_written > 0 {
                *frame_done = st.remaining == 0;
            }
            *input = &input[st.bytes_read..];
            if *filled == buf.len() || (*filled > 0 && left as usize == st.bytes_written) {
                emit(raw_crc, emitted, sink, &buf[..*filled])?;
                *filled = 0;
            }
            if st.bytes_read == 0 && st.bytes_written == 0 {
                if input.is_empty() {
                    return Ok(());
                }
                return Err(BlocksError::Codec(format!(
                    "zstd: {} stored bytes that decode to nothing",
                    input.len()
                )));
            }
        }
    }

    /// Ends the chunk once every stored byte has been pushed: hands on what is left and
    /// returns its [`Checksums`] for the caller to check against the manifest before it
    /// trusts what the sink was given.
    pub fn finish<E>(
        mut self,
        sink: &mut impl FnMut(u64, &[u8]) -> Result<(), E>,
    ) -> Result<Checksums, BlocksError<E>> {
        if self.received != self.stored_len {
            return Err(BlocksError::Codec(format!(
                "{} of {} stored bytes arrived",
                self.received, self.stored_len
            )));
        }
        if matches!(self.state, State::Zstd { .. }) {
            // No more input: what the decoder still holds comes out.
            self.feed_zstd(&[], sink)?;
        }
        match &mut self.state {
            State::Raw => {
                if let DecodedSum::Whole(c) = &mut self.raw_crc {
                    *c = self.stored_crc;
                }
            }
            State::Blocks { sizes, cur, .. } => {
                if *cur != sizes.len() {
                    return Err(BlocksError::Codec(format!(
                        "{cur} of {} blocks arrived",
                        sizes.len()
                    )));
                }
            }
            State::Zstd {
                buf,
                filled,
                frame_done,
                ..
            } => {
                emit(&mut self.raw_crc, &mut self.emitted, sink, &buf[..*filled])?;
                if !*frame_done || self.emitted != self.raw_len as u64 {
                    return Err(BlocksError::Codec(ends_before(self.raw_len)));
                }
            }
            State::Planes {
                width,
                plane_len,
                planes,
                tail,
                ..
            } => {
                let (w, plane_len) = (*width, *plane_len);
                // Every span with bytes was checked full as it ended (push); a compressed plane
                // whose span is empty holds no frame at all.
                for (k, p) in planes.iter().enumerate() {
                    if let Plane::Decoded {
                        buf,
                        filled,
                        frame_done,
                    } = p
                        && (*filled != buf.len() || !*frame_done)
                    {
                        return Err(BlocksError::Codec(format!(
                            "zstd plane {k}: {}",
                            ends_before(buf.len())
                        )));
                    }
                }
                let segs: Vec<Vec<&[u8]>> = planes
                    .iter()
                    .map(|p| match p {
                        Plane::Decoded { buf, .. } => vec![&buf[..]],
                        Plane::Pieces(v) => v.iter().map(|b| &b[..]).collect(),
                    })
                    .collect();
                let per_block = (self.block_bytes / w).max(1);
                let mut buf = vec![0u8; per_block.min(plane_len) * w];
                let mut at: Vec<(usize, usize)> = vec![(0, 0); w];
                let mut e = 0usize;
                while e < plane_len {
                    let n_block = per_block.min(plane_len - e);
                    let mut done = 0usize;
                    while done < n_block {
                        let mut views: [&[u8]; 8] = [&[]; 8];
                        let mut n = n_block - done;
                        for k in 0..w {
                            // Skip pieces used up (or empty).
                            while segs[k].get(at[k].0).is_some_and(|s| at[k].1 == s.len()) {
                                at[k] = (at[k].0 + 1, 0);
                            }
                            let s = segs[k]
                                .get(at[k].0)
                                .ok_or_else(|| BlocksError::Codec(format!("plane {k} is short")))?;
                            views[k] = &s[at[k].1..];
                            n = n.min(views[k].len());
                        }
                        gather_planes(&views[..w], w, 0, &mut buf[done * w..(done + n) * w]);
                        for a in at.iter_mut() {
                            a.1 += n;
                        }
                        done += n;
                    }
                    emit(
                        &mut self.raw_crc,
                        &mut self.emitted,
                        sink,
                        &buf[..n_block * w],
                    )?;
                    e += n_block;
                }
                for t in tail.iter() {
                    emit(&mut self.raw_crc, &mut self.emitted, sink, t)?;
                }
            }
        }
        if self.emitted != self.raw_len as u64 {
            return Err(BlocksError::Codec(format!(
                "decoded {} bytes, expected {}",
                self.emitted, self.raw_len
            )));
        }
        let raw = matches!(self.state, State::Raw);
        let summed_stored = self.sums_stored();
        let (decoded, blocks) = self.raw_crc.finish();
        Ok(Checksums {
            stored: if raw {
                Some(decoded)
            } else {
                summed_stored.then_some(self.stored_crc)
            },
            decoded,
            blocks,
        })
    }
}
