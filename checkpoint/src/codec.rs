//! Per-chunk compression: `raw` or `zstd-blocks`, which this build writes, and `zstd` and
//! `zstd-planes`, which format 2 wrote and this build still reads.
//!
//! `zstd-blocks` cuts a chunk into blocks of [`BLOCK_RAW_BYTES`] decoded bytes (the last may be
//! shorter), the same unit as a raw chunk's `block_crc32c`, and stores each block on its own, so
//! that a reader that needs part of a chunk fetches and decodes only the blocks that hold that
//! part. A stored block is a header of `width` little-endian `u32`s, one per byte plane (its
//! stored length, with [`BLOCK_PLANE_ZSTD`] set when it is one zstd frame), then the planes,
//! then the block's unaligned tail raw. Plane `k` holds byte `k` of every element of the block's
//! aligned prefix: on float weights the exponent planes compress well while mantissa planes are
//! noise, which plain zstd cannot see. Width 1 is plain zstd of the block. The manifest lists
//! each block's stored length.
//!
//! `zstd-planes` (format 2) did the same with whole-chunk planes, and `zstd` with one frame.
//!
//! The choice is made per chunk; a chunk is stored raw when compression does not pay.

use serde::{Deserialize, Serialize};

mod stream;
pub use stream::{Checksums, ChunkDecoder};

/// zstd level used for chunks: level 1 is the speed/ratio sweet spot on weights.
pub const ZSTD_LEVEL: i32 = 1;
/// A compressed form is kept only when it is at most this fraction of the input (in 1/1000).
const PAYS_PER_MILLE: usize = 970;
/// The decoded bytes of each block of a `zstd-blocks` chunk (the last may hold fewer): the unit
/// of a raw chunk's `block_crc32c` too, so every chunk is read in part the same way.
pub const BLOCK_RAW_BYTES: u64 = crate::format::CHECK_BLOCK_BYTES;
/// Set in a `zstd-blocks` plane's header word when the plane is one zstd frame.
pub const BLOCK_PLANE_ZSTD: u32 = 1 << 31;
/// After a plane of a block did not shrink, the same plane of this many following blocks is
/// stored raw without trying: mantissa planes are noise, and compressing them costs a pass.
const RETRY_AFTER_BLOCKS: usize = 16;

/// How one plane is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlaneEntry {
    pub zstd: bool,
    pub stored_bytes: u64,
}

/// The codec of one stored object, as recorded in the manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "name", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Codec {
    Raw,
    Zstd,
    ZstdPlanes {
        width: u8,
        planes: Vec<PlaneEntry>,
    },
    /// The stored length of each block, in order.
    ZstdBlocks {
        width: u8,
        blocks: Vec<u64>,
    },
}

/// The decoded bytes `[start, end)` of block `block` of a chunk of `raw_bytes` bytes.
pub fn block_raw_range(raw_bytes: u64, block: u64) -> (u64, u64) {
    let start = block.saturating_mul(BLOCK_RAW_BYTES).min(raw_bytes);
    (start, start.saturating_add(BLOCK_RAW_BYTES).min(raw_bytes))
}

/// The most stored bytes a `zstd-blocks` block of `raw` decoded bytes may take: its header, and
/// planes that are never stored larger than raw (the encoder keeps a plane raw unless zstd
/// shrinks it).
fn block_stored_max(raw: u64, width: u64) -> u64 {
    4 * width + raw
}

impl Codec {
    pub fn name(&self) -> &'static str {
        match self {
            Codec::Raw => "raw",
            Codec::Zstd => "zstd",
            Codec::ZstdPlanes { .. } => "zstd-planes",
            Codec::ZstdBlocks { .. } => "zstd-blocks",
        }
    }

    /// Checks the codec's own numbers against the object's lengths.
    pub fn check(&self, raw_bytes: u64, stored_bytes: u64) -> Result<(), String> {
        match self {
            Codec::Raw if raw_bytes != stored_bytes => Err(format!(
                "raw codec but stored_bytes {stored_bytes} != raw_bytes {raw_bytes}"
            )),
            Codec::Raw | Codec::Zstd => Ok(()),
            Codec::ZstdPlanes { width, planes } => {
                let w = u64::from(*width);
                if !matches!(w, 2 | 4 | 8) || planes.len() as u64 != w {
                    return Err(format!(
                        "zstd-planes width {width} with {} planes",
                        planes.len()
                    ));
                }
                let plane_bytes = raw_bytes / w;
                let mut total = raw_bytes % w;
                for p in planes {
                    if !p.zstd && p.stored_bytes != plane_bytes {
                        return Err(format!(
                            "raw plane of {} bytes, expected {plane_bytes}",
                            p.stored_bytes
                        ));
                    }
                    total = total
                        .checked_add(p.stored_bytes)
                        .ok_or("plane lengths overflow")?;
                }
                if total != stored_bytes {
                    return Err(format!(
                        "planes and tail add up to {total} bytes, object has {stored_bytes}"
                    ));
                }
                Ok(())
            }
            Codec::ZstdBlocks { width, blocks } => {
                let w = u64::from(*width);
                if !matches!(w, 1 | 2 | 4 | 8) {
                    return Err(format!("zstd-blocks width {width}"));
                }
                let want = raw_bytes.div_ceil(BLOCK_RAW_BYTES);
                if blocks.len() as u64 != want {
                    return Err(format!(
                        "zstd-blocks: {} blocks for {raw_bytes} bytes (want {want})",
                        blocks.len()
                    ));
                }
                let mut total = 0u64;
                for (i, &n) in blocks.iter().enumerate() {
                    let (a, b) = block_raw_range(raw_bytes, i as u64);
                    if n < 4 * w || n > block_stored_max(b - a, w) {
                        return Err(format!(
                            "zstd-blocks block {i}: {n} stored bytes for {} decoded",
                            b - a
                        ));
                    }
                    total = total.checked_add(n).ok_or("block lengths overflow")?;
                }
                if total != stored_bytes {
                    return Err(format!(
                        "blocks add up to {total} bytes, object has {stored_bytes}"
                    ));
                }
                Ok(())
            }
        }
    }

    /// The stored bytes `[start, end)` of each block of a chunk of `raw_bytes` bytes read in
    /// blocks of [`BLOCK_RAW_BYTES`] (a raw chunk's `block_crc32c`, or `zstd-blocks`); `None`
    /// for the codecs of format 2, which are read whole.
    pub fn stored_blocks(&self, raw_bytes: u64) -> Option<Vec<(u64, u64)>> {
        match self {
            Codec::Raw => Some(
                (0..raw_bytes.div_ceil(BLOCK_RAW_BYTES))
                    .map(|b| block_raw_range(raw_bytes, b))
                    .collect(),
            ),
            Codec::ZstdBlocks { blocks, .. } => {
                let mut at = 0u64;
                Some(
                    blocks
                        .iter()
                        .map(|&n| {
                            let r = (at, at.saturating_add(n));
                            at = r.1;
                            r
                        })
                        .collect(),
                )
            }
            Codec::Zstd | Codec::ZstdPlanes { .. } => None,
        }
    }
}

/// Plane `k` of width-`w` elements: byte `k` of every element. Monomorphized per width so
/// the loop compiles to strided loads without bounds checks.
fn extract_plane(raw: &[u8], w: usize, k: usize, plane: &mut [u8]) {
    fn go<const W: usize>(raw: &[u8], k: usize, plane: &mut [u8]) {
        for (dst, el) in plane.iter_mut().zip(raw.chunks_exact(W)) {
            *dst = el[k];
        }
    }
    match w {
        2 => go::<2>(raw, k, plane),
        4 => go::<4>(raw, k, plane),
        _ => go::<8>(raw, k, plane),
    }
}

/// Bytes compressed to probe whether a large buffer compresses at all.
const PROBE_BYTES: usize = 256 * 1024;

fn zstd_if_pays(data: &[u8], level: i32) -> Option<Vec<u8>> {
    if data.is_empty() {
        return None;
    }
    // Noise (mantissa planes) costs a full compression pass for nothing: probe a sample first.
    if data.len() > 4 * PROBE_BYTES {
        let probe = zstd::bulk::compress(&data[..PROBE_BYTES], level).ok()?;
        if probe.len() * 1000 > PROBE_BYTES * PAYS_PER_MILLE {
            return None;
        }
    }
    let c = zstd::bulk::compress(data, level).ok()?;
    (c.len() * 1000 <= data.len() * PAYS_PER_MILLE).then_some(c)
}

/// Encodes a chunk. `plane_width` is the element size of the float dtype that fills the chunk,
/// if any; `compress == false` stores raw. A compressed chunk is `zstd-blocks`.
pub fn encode(raw: &[u8], plane_width: Option<u8>, compress: bool) -> (Vec<u8>, Codec) {
    if !compress || raw.is_empty() {
        return (raw.to_vec(), Codec::Raw);
    }
    let width = plane_width.filter(|w| matches!(w, 2 | 4 | 8)).unwrap_or(1);
    match encode_blocks(raw, usize::from(width)) {
        Some((out, blocks)) if out.len() * 1000 <= raw.len() * PAYS_PER_MILLE => {
            (out, Codec::ZstdBlocks { width, blocks })
        }
        _ => (raw.to_vec(), Codec::Raw),
    }
}

/// The `zstd-blocks` form of `raw` in planes of width `w`, and each block's stored length;
/// `None` if zstd cannot start.
fn encode_blocks(raw: &[u8], w: usize) -> Option<(Vec<u8>, Vec<u64>)> {
    let mut cctx = zstd::bulk::Compressor::new(ZSTD_LEVEL).ok()?;
    let block_len = BLOCK_RAW_BYTES as usize;
    let mut out = Vec::with_capacity(raw.len() + raw.len().div_ceil(block_len) * 4 * w);
    let mut sizes = Vec::with_capacity(raw.len().div_ceil(block_len));
    let mut plane = vec![
        0u8;
        if w == 1 {
            0
        } else {
            block_len.min(raw.len()) / w
        }
    ];
    // The block from which each plane is tried again after it did not shrink.
    let mut try_from = [0usize; 8];
    for (b, block) in raw.chunks(block_len).enumerate() {
        let start = out.len();
        let aligned = block.len() - block.len() % w;
        let n = aligned / w;
        out.resize(start + 4 * w, 0);
        for k in 0..w {
            let p: &[u8] = if w == 1 {
                &block[..aligned]
            } else {
                extract_plane(&block[..aligned], w, k, &mut plane[..n]);
                &plane[..n]
            };
            let mut word = n as u32;
            if n > 0 && b >= try_from[k] {
                let at = out.len();
                out.resize(at + zstd::zstd_safe::compress_bound(n), 0);
                match cctx.compress_to_buffer(p, &mut out[at..]) {
                    Ok(c) if c * 1000 <= n * PAYS_PER_MILLE => {
                        out.truncate(at + c);
                        word = c as u32 | BLOCK_PLANE_ZSTD;
                    }
                    _ => {
                        out.truncate(at);
                        try_from[k] = b + 1 + RETRY_AFTER_BLOCKS;
                    }
                }
            }
            if word & BLOCK_PLANE_ZSTD == 0 {
                out.extend_from_slice(p);
            }
            out[start + 4 * k..start + 4 * k + 4].copy_from_slice(&word.to_le_bytes());
        }
        out.extend_from_slice(&block[aligned..]);
        sizes.push((out.len() - start) as u64);
    }
    Some((out, sizes))
}

/// Decodes the blocks of a `zstd-blocks` chunk one at a time, each from its stored bytes alone,
/// reusing its buffers and zstd context across blocks (and chunks of the same width).
pub struct BlockDecoder {
    width: usize,
    dctx: zstd::bulk::Decompressor<'static>,
    /// Decompressed planes of the block, one after another.
    planes: Vec<u8>,
    out: Vec<u8>,
}

impl BlockDecoder {
    pub fn new(width: u8) -> Result<Self, String> {
        let width = usize::from(width);
        if !matches!(width, 1 | 2 | 4 | 8) {
            return Err(format!("zstd-blocks width {width}"));
        }
        Ok(Self {
            width,
            dctx: zstd::bulk::Decompressor::new().map_err(|e| format!("zstd: {e}"))?,
            planes: Vec::new(),
            out: Vec::new(),
        })
    }

    /// The `raw_len` decoded bytes of one block stored as `stored`; an error names what in
    /// the block disagrees. Never writes past `raw_len` bytes, whatever `stored` holds.
    pub fn decode(&mut self, stored: &[u8], raw_len: usize) -> Result<&[u8], String> {
        let w = self.width;
        let header = 4 * w;
        if stored.len() < header {
            return Err(format!(
                "block of {} stored bytes is shorter than its {header}-byte header",
                stored.len()
            ));
        }
        let aligned = raw_len - raw_len % w;
        let n = aligned / w;
        self.out.resize(raw_len, 0);
        self.planes.resize(if w == 1 { 0 } else { aligned }, 0);
        let mut spans = [(false, 0usize, 0usize); 8];
        let mut at = header;
        for (k, span) in spans.iter_mut().enumerate().take(w) {
            let mut word = [0u8; 4];
            word.copy_from_slice(&stored[4 * k..4 * k + 4]);
            let word = u32::from_le_bytes(word);
            let zstd = word & BLOCK_PLANE_ZSTD != 0;
            let len = (word & !BLOCK_PLANE_ZSTD) as usize;
            let end = at
                .checked_add(len)
                .filter(|&e| e <= stored.len())
                .ok_or_else(|| {
                    format!(
                        "plane {k} of {len} bytes runs past the block's {} stored bytes",
                        stored.len()
                    )
                })?;
            if zstd {
                let dst = if w == 1 {
                    &mut self.out[..aligned]
                } else {
                    &mut self.planes[k * n..(k + 1) * n]
                };
                let got = self
                    .dctx
                    .decompress_to_buffer(&stored[at..end], dst)
                    .map_err(|e| format!("plane {k}: zstd: {e}"))?;
                if got != n {
                    return Err(format!(
                        "plane {k}: zstd frame decodes to {got} bytes, want {n}"
                    ));
                }
            } else if len != n {
                return Err(format!("raw plane {k} of {len} bytes, want {n}"));
            }
            *span = (zstd, at, end);
            at = end;
        }
        if stored.len() - at != raw_len - aligned {
            return Err(format!(
                "planes end {} bytes before the block's end, its tail is {} bytes",
                stored.len() - at,
                raw_len - aligned
            ));
        }
        if w == 1 {
            if !spans[0].0 {
                self.out[..aligned].copy_from_slice(&stored[spans[0].1..spans[0].2]);
            }
        } else {
            let mut views: [&[u8]; 8] = [&[]; 8];
            for (k, &(zstd, a, b)) in spans.iter().enumerate().take(w) {
                views[k] = if zstd {
                    &self.planes[k * n..(k + 1) * n]
                } else {
                    &stored[a..b]
                };
            }
            gather_planes(&views[..w], w, 0, &mut self.out[..aligned]);
        }
        self.out[aligned..].copy_from_slice(&stored[at..]);
        Ok(&self.out)
    }
}

/// Encodes a chunk as format 2 did (`zstd-planes` over whole-chunk planes, or one `zstd`
/// frame), which this build still reads: for tests of that reading.
#[doc(hidden)]
pub fn encode_format2(raw: &[u8], plane_width: Option<u8>, compress: bool) -> (Vec<u8>, Codec) {
    if !compress || raw.is_empty() {
        return (raw.to_vec(), Codec::Raw);
    }
    if let Some(width) = plane_width.filter(|w| matches!(w, 2 | 4 | 8)) {
        let w = usize::from(width);
        let aligned = raw.len() - raw.len() % w;
        if aligned > 0 {
            let mut out = Vec::with_capacity(raw.len());
            let mut planes = Vec::with_capacity(w);
            let mut plane = vec![0u8; aligned / w];
            for k in 0..w {
                extract_plane(&raw[..aligned], w, k, &mut plane);
                match zstd_if_pays(&plane, ZSTD_LEVEL) {
                    Some(c) => {
                        planes.push(PlaneEntry {
                            zstd: true,
                            stored_bytes: c.len() as u64,
                        });
                        out.extend_from_slice(&c);
                    }
                    None => {
                        planes.push(PlaneEntry {
                            zstd: false,
                            stored_bytes: plane.len() as u64,
                        });
                        out.extend_from_slice(&plane);
                    }
                }
            }
            out.extend_from_slice(&raw[aligned..]);
            if out.len() * 1000 <= raw.len() * PAYS_PER_MILLE {
                return (out, Codec::ZstdPlanes { width, planes });
            }
            return (raw.to_vec(), Codec::Raw);
        }
    }
    match zstd_if_pays(raw, ZSTD_LEVEL) {
        Some(c) => (c, Codec::Zstd),
        None => (raw.to_vec(), Codec::Raw),
    }
}

/// Decodes a stored chunk into exactly `raw_bytes` bytes. Never allocates more than
/// `raw_bytes` for the output; any disagreement is an error string naming what is off.
pub fn decode(stored: &[u8], codec: &Codec, raw_bytes: u64) -> Result<Vec<u8>, String> {
    let mut d = ChunkDecoder::new(codec, raw_bytes, stored.len() as u64, 1 << 20)?;
    let mut out = Vec::with_capacity(usize::try_from(raw_bytes).unwrap_or(0));
    let mut sink = |_: u64, b: &[u8]| {
        out.extend_from_slice(b);
        Ok::<_, std::convert::Infallible>(())
    };
    let never = |e: BlocksError<std::convert::Infallible>| match e {
        BlocksError::Codec(reason) => reason,
        BlocksError::Sink(never) => match never {},
    };
    d.push(bytes::Bytes::copy_from_slice(stored), &mut sink)
        .map_err(never)?;
    d.finish(&mut sink).map_err(never)?;
    Ok(out)
}

/// Why a [`ChunkDecoder`] stopped: the stored bytes do not decode as the codec says, or the
/// sink refused a block.
#[derive(Debug)]
pub enum BlocksError<E> {
    Codec(String),
    Sink(E),
}

/// Decodes a stored chunk as [`decode`] does, without ever holding the decoded chunk: its
/// bytes go to `sink(offset, bytes)` in order, in blocks of at most `block_bytes`; see
/// [`ChunkDecoder`], which this feeds with `stored` in pieces of `piece_bytes`. Returns the
/// crc32c of the decoded bytes, for the caller to check before it trusts what the sink wrote.
pub fn decode_blocks<E>(
    stored: &[u8],
    codec: &Codec,
    raw_bytes: u64,
    block_bytes: usize,
    piece_bytes: usize,
    mut sink: impl FnMut(u64, &[u8]) -> Result<(), E>,
) -> Result<u32, BlocksError<E>> {
    let mut d = ChunkDecoder::new(codec, raw_bytes, stored.len() as u64, block_bytes)
        .map_err(BlocksError::Codec)?;
    let stored = bytes::Bytes::copy_from_slice(stored);
    let mut at = 0;
    while at < stored.len() {
        let n = piece_bytes.max(1).min(stored.len() - at);
        d.push(stored.slice(at..at + n), &mut sink)?;
        at += n;
    }
    Ok(d.finish(&mut sink)?.decoded)
}

/// Elements `[e0, e0 + out.len() / w)` of width `w` put back together from their byte
/// `planes`: the inverse of [`extract_plane`] for a range of elements. Written as zips of
/// slices of equal length, so the loop has no bounds checks and vectorizes.
fn gather_planes(planes: &[&[u8]], w: usize, e0: usize, out: &mut [u8]) {
    let n = out.len() / w;
    let p = |k: usize| &planes[k][e0..e0 + n];
    match w {
        2 => {
            for ((el, a), b) in out.chunks_exact_mut(2).zip(p(0)).zip(p(1)) {
                el.copy_from_slice(&[*a, *b]);
            }
        }
        4 => {
            for ((((el, a), b), c), d) in out
                .chunks_exact_mut(4)
                .zip(p(0))
                .zip(p(1))
                .zip(p(2))
                .zip(p(3))
            {
                el.copy_from_slice(&[*a, *b, *c, *d]);
            }
        }
        _ => {
            // Two passes of four planes each: the high and low halves of every element.
            for half in 0..2 {
                let k = 4 * half;
                for ((((el, a), b), c), d) in out
                    .chunks_exact_mut(8)
                    .zip(p(k))
                    .zip(p(k + 1))
                    .zip(p(k + 2))
                    .zip(p(k + 3))
                {
                    el[k..k + 4].copy_from_slice(&[*a, *b, *c, *d]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngExt, SeedableRng};

    /// Float-like bytes: a narrow normal-ish distribution, so exponent planes are compressible.
    fn weights(n_elems: usize, width: u8, seed: u64) -> Vec<u8> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut out = Vec::new();
        for _ in 0..n_elems {
            let x: f32 = (rng.random::<f32>() - 0.5) * 0.04;
            match width {
                2 => out.extend_from_slice(&x.to_bits().to_le_bytes()[2..]),
                4 => out.extend_from_slice(&x.to_le_bytes()),
                _ => out.extend_from_slice(&f64::from(x).to_le_bytes()),
            }
        }
        out
    }

    #[test]
    fn every_codec_round_trips_every_dtype_and_odd_length() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for dtype in [
            "BOOL", "U8", "I8", "F8_E4M3", "I16", "F16", "BF16", "I32", "F32", "I64", "F64",
        ] {
            let width = crate::header::plane_width_for(dtype);
            for len in [0usize, 1, 2, 3, 5, 7, 8, 9, 1023, 4096, 65_537] {
                let w = width.unwrap_or(4);
                let mut data = weights(len / usize::from(w) + 1, w, len as u64);
                assert!(data.len() >= len);
                data.truncate(len);
                if len % 3 == 0 {
                    data.iter_mut().for_each(|b| *b = rng.random());
                }
                for compress in [false, true] {
                    for enc in [encode, encode_format2] {
                        let (stored, codec) = enc(&data, width, compress);
                        let back = decode(&stored, &codec, len as u64).unwrap();
                        assert_eq!(back, data, "{dtype} len {len} codec {codec:?}");
                    }
                }
            }
        }
    }

    /// Every block `decode_blocks` hands over, put together, with its crc32c.
    fn blocks_of(
        stored: &[u8],
        codec: &Codec,
        raw: u64,
        block: usize,
        piece: usize,
    ) -> Result<(Vec<u8>, u32), String> {
        let mut out = Vec::new();
        let crc = decode_blocks(stored, codec, raw, block, piece, |at, b| {
            assert_eq!(at, out.len() as u64, "blocks come in order, without gaps");
            assert!(!b.is_empty() && b.len() <= block.max(8));
            out.extend_from_slice(b);
            Ok::<_, ()>(())
        })
        .map_err(|e| match e {
            BlocksError::Codec(s) => s,
            BlocksError::Sink(()) => "sink".into(),
        })?;
        Ok((out, crc))
    }

    #[test]
    fn decode_blocks_hands_over_what_decode_gives_in_blocks_of_any_size() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        for dtype in ["U8", "BF16", "F32", "F64"] {
            let width = crate::header::plane_width_for(dtype);
            for len in [0usize, 1, 3, 9, 1023, 4096, 65_537] {
                let w = width.unwrap_or(4);
                let mut data = weights(len / usize::from(w) + 1, w, len as u64);
                data.truncate(len);
                if len % 3 == 0 {
                    data.iter_mut().for_each(|b| *b = rng.random());
                }
                let zeros = vec![0u8; len];
                for (input, compress, enc) in [
                    (
                        &data,
                        false,
                        encode as fn(&[u8], Option<u8>, bool) -> (Vec<u8>, Codec),
                    ),
                    (&data, true, encode),
                    (&zeros, true, encode),
                    (&data, true, encode_format2),
                    (&zeros, true, encode_format2),
                ] {
                    let (stored, codec) = enc(input, width, compress);
                    for block in [1usize, 7, 8, 100, 4096, 1 << 20] {
                        // The stored bytes arrive in pieces that cut planes, frames and the
                        // tail anywhere.
                        let pieces: &[usize] = if len <= 1023 {
                            &[1, 7, 1000, usize::MAX]
                        } else {
                            &[7, 1000, usize::MAX]
                        };
                        for &piece in pieces {
                            let (got, crc) =
                                blocks_of(&stored, &codec, len as u64, block, piece).unwrap();
                            assert_eq!(
                                &got, input,
                                "{dtype} len {len} {codec:?} block {block} piece {piece}"
                            );
                            assert_eq!(crc, crc32c::crc32c(input));
                        }
                    }
                }
            }
        }
    }

    /// Summed by block, a chunk's decoder gives the block checksums the save wrote and their
    /// combination as the decoded checksum, whatever pieces the stored bytes come in; the
    /// stored checksum is the same as when summed whole.
    #[test]
    fn block_sums_match_the_saved_block_checksums_in_any_pieces() {
        let len = 3 * BLOCK_RAW_BYTES as usize + 77;
        let data = weights(len / 2 + 1, 2, 21)[..len].to_vec();
        let want_blocks = crate::format::BlockCrcs::of(&data);
        assert_eq!(want_blocks.len(), 4);
        for compress in [false, true] {
            let (stored, codec) = encode(&data, Some(2), compress);
            assert_eq!(codec.name(), if compress { "zstd-blocks" } else { "raw" });
            let stored = bytes::Bytes::from(stored);
            for by_block in [false, true] {
                for piece in [1000usize, 65_536, usize::MAX] {
                    let mut d = ChunkDecoder::new(&codec, len as u64, stored.len() as u64, 1 << 16)
                        .unwrap();
                    if by_block {
                        d.sum_blocks();
                    }
                    let mut out = Vec::new();
                    let mut sink = |at: u64, b: &[u8]| {
                        assert_eq!(at, out.len() as u64);
                        out.extend_from_slice(b);
                        Ok::<_, ()>(())
                    };
                    let mut at = 0;
                    while at < stored.len() {
                        let n = piece.min(stored.len() - at);
                        d.push(stored.slice(at..at + n), &mut sink).unwrap();
                        at += n;
                    }
                    let sums = d.finish(&mut sink).unwrap();
                    let what = format!("{codec:?} by block {by_block} piece {piece}");
                    assert_eq!(out, data, "{what}");
                    let blocks = by_block.then_some(&want_blocks[..]);
                    assert_eq!(sums.blocks.as_deref(), blocks, "{what}");
                    assert_eq!(sums.decoded, crc32c::crc32c(&data), "{what}");
                    assert_eq!(sums.stored, crc32c::crc32c(&stored), "{what}");
                }
            }
        }
    }

    #[test]
    fn decode_blocks_refuses_damaged_or_mislabelled_chunks_and_stops_at_a_refusing_sink() {
        let data = weights(20_000, 4, 5);
        let (stored, codec) = encode_format2(&data, Some(4), true);
        assert_eq!(codec.name(), "zstd-planes");
        let n = data.len() as u64;
        assert!(blocks_of(&stored, &codec, n + 1, 4096, 100).is_err());
        assert!(blocks_of(&stored[..stored.len() - 1], &codec, n, 4096, 100).is_err());
        let mut bad = stored.clone();
        bad[10] ^= 0xff;
        if let Ok((got, crc)) = blocks_of(&bad, &codec, n, 4096, 100) {
            assert!(got != data && crc != crc32c::crc32c(&data));
        }
        let zeros = vec![0u8; 50_000];
        let (z, zc) = encode_format2(&zeros, None, true);
        assert_eq!(zc, Codec::Zstd);
        let short = blocks_of(&z, &zc, 50_001, 4096, 100).unwrap_err();
        assert!(short.contains("ends before"), "{short}");
        let long = blocks_of(&z, &zc, 49_999, 4096, 100).unwrap_err();
        assert!(long.contains("more than"), "{long}");
        assert!(blocks_of(&z[..z.len() / 2], &zc, 50_000, 4096, 100).is_err());
        let mut calls = 0;
        let r = decode_blocks(&z, &zc, 50_000, 4096, usize::MAX, |_, _| {
            calls += 1;
            if calls == 3 { Err("full") } else { Ok(()) }
        });
        assert!(matches!(r, Err(BlocksError::Sink("full"))));
        assert_eq!(calls, 3);
    }

    /// A compressed plane whose span holds more than its frame (stray bytes, or a second
    /// frame) is refused wherever the pieces cut it, never decoded into the next plane.
    #[test]
    fn a_plane_span_with_more_than_its_frame_is_refused_in_any_pieces() {
        let data = weights(20_000, 4, 11);
        let (stored, codec) = encode_format2(&data, Some(4), true);
        let Codec::ZstdPlanes { width, planes } = &codec else {
            panic!("{codec:?}")
        };
        let k = planes
            .iter()
            .position(|p| p.zstd)
            .expect("a compressed plane");
        let start: usize = planes[..k].iter().map(|p| p.stored_bytes as usize).sum();
        let end = start + planes[k].stored_bytes as usize;
        let frame = stored[start..end].to_vec();
        for extra in [vec![0u8; 5], frame.clone()] {
            let mut bad = stored[..end].to_vec();
            bad.extend_from_slice(&extra);
            bad.extend_from_slice(&stored[end..]);
            let mut planes = planes.clone();
            planes[k].stored_bytes += extra.len() as u64;
            let bad_codec = Codec::ZstdPlanes {
                width: *width,
                planes,
            };
            for piece in [1usize, 3, 4096, usize::MAX] {
                let r = blocks_of(&bad, &bad_codec, data.len() as u64, 4096, piece);
                assert!(r.is_err(), "extra {} bytes, piece {piece}", extra.len());
            }
            assert!(decode(&bad, &bad_codec, data.len() as u64).is_err());
        }
    }

    /// A forged manifest that gives a compressed plane no bytes at all: refused, not decoded
    /// into zeros.
    #[test]
    fn a_compressed_plane_with_an_empty_span_is_refused() {
        let data = weights(1000, 4, 12);
        let plane_len = 1000u64;
        let mut stored = Vec::new();
        let mut planes = vec![PlaneEntry {
            zstd: true,
            stored_bytes: 0,
        }];
        for k in 1..4 {
            stored.extend(data.chunks_exact(4).map(|el| el[k]));
            planes.push(PlaneEntry {
                zstd: false,
                stored_bytes: plane_len,
            });
        }
        let codec = Codec::ZstdPlanes { width: 4, planes };
        codec.check(4000, stored.len() as u64).unwrap();
        for piece in [1usize, 999, usize::MAX] {
            let err = blocks_of(&stored, &codec, 4000, 4096, piece).unwrap_err();
            assert!(err.contains("plane 0"), "{err}");
        }
    }

    #[test]
    fn planes_beat_plain_zstd_on_bf16_weights_and_random_bytes_stay_raw() {
        let data = weights(1 << 16, 2, 1);
        let (stored, codec) = encode(&data, Some(2), true);
        assert_eq!(codec.name(), "zstd-blocks");
        let plain = zstd::bulk::compress(&data, ZSTD_LEVEL).unwrap();
        assert!(
            stored.len() < plain.len(),
            "{} vs {}",
            stored.len(),
            plain.len()
        );
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let noise: Vec<u8> = (0..100_000).map(|_| rng.random()).collect();
        assert_eq!(encode(&noise, Some(4), true).1, Codec::Raw);
        assert_eq!(encode(&noise, None, true).1, Codec::Raw);
        assert_eq!(encode_format2(&noise, Some(4), true).1, Codec::Raw);
        let zeros = vec![0u8; 10_000];
        assert_eq!(
            encode(&zeros, None, true).1,
            Codec::ZstdBlocks {
                width: 1,
                blocks: vec![encode(&zeros, None, true).0.len() as u64]
            }
        );
        assert_eq!(encode_format2(&zeros, None, true).1, Codec::Zstd);
    }

    #[test]
    fn large_chunks_take_the_probe_path_and_still_round_trip() {
        let mut data = weights(1 << 20, 4, 9);
        data.push(7); // odd tail
        let (stored, codec) = encode_format2(&data, Some(4), true);
        let Codec::ZstdPlanes { planes, .. } = &codec else {
            panic!("{codec:?}")
        };
        assert!(planes[3].zstd, "the exponent plane compresses");
        assert_eq!(decode(&stored, &codec, data.len() as u64).unwrap(), data);
    }

    #[test]
    fn decode_rejects_inconsistent_lengths_without_panicking() {
        let data = weights(1000, 4, 2);
        for enc in [encode, encode_format2] {
            let (stored, codec) = enc(&data, Some(4), true);
            assert!(decode(&stored, &codec, 4001).is_err());
            assert!(decode(&stored[..stored.len() - 1], &codec, 4000).is_err());
            let (z, zc) = enc(&vec![0u8; 5000], None, true);
            assert!(decode(&z, &zc, 4999).is_err());
            assert!(decode(&z, &zc, 5001).is_err());
        }
        assert!(decode(b"garbage!", &Codec::Zstd, 8).is_err());
        let bad = Codec::ZstdPlanes {
            width: 3,
            planes: vec![],
        };
        assert!(decode(b"", &bad, 0).is_err());
    }

    /// A `zstd-blocks` chunk of several blocks, of every width: it round-trips whole and in
    /// pieces; each block decodes alone from its own stored bytes into the decoded bytes of
    /// its range (what a ranged read relies on); mantissa planes stay raw and exponent planes
    /// compress.
    #[test]
    fn zstd_blocks_decode_whole_in_pieces_and_one_block_at_a_time() {
        const B: usize = BLOCK_RAW_BYTES as usize;
        for (width, len) in [(2u8, 3 * B + 6), (4, 2 * B + 4), (8, B + 8), (4, 2 * B + 3)] {
            let w = usize::from(width);
            let mut data = weights(len / w + 1, width, len as u64);
            data.truncate(len);
            let (stored, codec) = encode(&data, Some(width), true);
            let Codec::ZstdBlocks { width: cw, blocks } = &codec else {
                panic!("{codec:?}")
            };
            assert_eq!((*cw, blocks.len()), (width, len.div_ceil(B)));
            codec.check(len as u64, stored.len() as u64).unwrap();
            assert_eq!(decode(&stored, &codec, len as u64).unwrap(), data);
            for piece in [4096usize, 100_003, usize::MAX] {
                let (got, crc) = blocks_of(&stored, &codec, len as u64, 65_536, piece).unwrap();
                assert_eq!(got, data, "width {width} piece {piece}");
                assert_eq!(crc, crc32c::crc32c(&data));
            }
            let ranges = codec.stored_blocks(len as u64).unwrap();
            let mut dec = BlockDecoder::new(width).unwrap();
            for (i, &(a, b)) in ranges.iter().enumerate() {
                let (ra, rb) = block_raw_range(len as u64, i as u64);
                let block = &stored[a as usize..b as usize];
                let got = dec.decode(block, (rb - ra) as usize).unwrap();
                assert_eq!(
                    got,
                    &data[ra as usize..rb as usize],
                    "width {width} block {i}"
                );
                // The header: the exponent plane (the last) compressed.
                if i + 1 < ranges.len() {
                    let word =
                        |k: usize| u32::from_le_bytes(block[4 * k..4 * k + 4].try_into().unwrap());
                    assert!(
                        word(w - 1) & BLOCK_PLANE_ZSTD != 0,
                        "width {width} block {i}"
                    );
                }
            }
        }
    }

    /// Blocks whose stored lengths or headers are forged are refused, named by block, and never
    /// decoded into something else; the codec's numbers are checked before a byte is read.
    #[test]
    fn forged_zstd_blocks_are_refused() {
        const B: usize = BLOCK_RAW_BYTES as usize;
        let len = 3 * B;
        let data = weights(len / 4, 4, 21);
        let (stored, codec) = encode(&data, Some(4), true);
        let Codec::ZstdBlocks { blocks, .. } = &codec else {
            panic!("{codec:?}")
        };
        let n = len as u64;
        let with = |blocks: Vec<u64>| Codec::ZstdBlocks { width: 4, blocks };
        // The numbers: a block too many or too few, lengths that do not add up, a block
        // shorter than its header or longer than any encoder writes, a width of 3.
        let mut more = blocks.clone();
        more.push(16);
        assert!(with(more).check(n, stored.len() as u64 + 16).is_err());
        assert!(
            with(blocks[..2].to_vec())
                .check(n, stored.len() as u64)
                .is_err()
        );
        assert!(
            with(blocks.clone())
                .check(n, stored.len() as u64 + 1)
                .is_err()
        );
        let mut tiny = blocks.clone();
        (tiny[0], tiny[1]) = (15, tiny[1] + tiny[0] - 15);
        assert!(with(tiny).check(n, stored.len() as u64).is_err());
        let huge = vec![0, 0, stored.len() as u64];
        assert!(with(huge).check(n, stored.len() as u64).is_err());
        let bad_width = Codec::ZstdBlocks {
            width: 3,
            blocks: blocks.clone(),
        };
        assert!(bad_width.check(n, stored.len() as u64).is_err());
        // Lengths that add up but cut the blocks elsewhere: refused by the block they break.
        let mut moved = blocks.clone();
        (moved[0], moved[1]) = (moved[0] - 1, moved[1] + 1);
        let moved = with(moved);
        moved.check(n, stored.len() as u64).unwrap();
        let err = decode(&stored, &moved, n).unwrap_err();
        assert!(err.contains("block 0"), "{err}");
        // A header whose plane runs past the block, and a raw plane of the wrong length.
        let mut dec = BlockDecoder::new(4).unwrap();
        let first = &stored[..blocks[0] as usize];
        let mut past = first.to_vec();
        past[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
        let err = dec.decode(&past, B).unwrap_err();
        assert!(err.contains("plane 0") && err.contains("past"), "{err}");
        let mut short_raw = first.to_vec();
        short_raw[0..4].copy_from_slice(&((B / 4 - 1) as u32).to_le_bytes());
        assert!(dec.decode(&short_raw, B).is_err());
        assert!(dec.decode(&first[..10], B).unwrap_err().contains("header"));
        // A flipped bit in a compressed plane: an error, or bytes whose checksum differs.
        let mut flipped = first.to_vec();
        let at = flipped.len() - 20;
        flipped[at] ^= 0x40;
        if let Ok(got) = dec.decode(&flipped, B) {
            assert_ne!(crc32c::crc32c(got), crc32c::crc32c(&data[..B]));
        }
        // The decoder still decodes good blocks after bad ones.
        assert_eq!(dec.decode(first, B).unwrap(), &data[..B]);
    }

    /// Seeded mutations of a real `zstd-blocks` chunk (bytes flipped, cut, or blocks
    /// re-measured) decode whole, in pieces, or a block at a time without a panic, and what
    /// decodes has the length asked for: the stable run of what the fuzz target checks.
    #[test]
    fn mutated_zstd_blocks_never_panic() {
        const B: usize = BLOCK_RAW_BYTES as usize;
        let len = 2 * B + 100;
        let data = weights(len / 4, 4, 31);
        let (stored, codec) = encode(&data, Some(4), true);
        let Codec::ZstdBlocks { blocks, .. } = &codec else {
            panic!("{codec:?}")
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(32);
        let mut dec = BlockDecoder::new(4).unwrap();
        for round in 0..200 {
            let mut bad = stored.clone();
            let mut sizes = blocks.clone();
            for _ in 0..1 + round % 4 {
                let at = rng.random_range(0..bad.len());
                bad[at] = rng.random();
            }
            if round % 5 == 0 {
                bad.truncate(rng.random_range(0..bad.len()));
            }
            if round % 7 == 0 {
                let d = rng.random_range(0..64u64);
                sizes[0] = sizes[0].saturating_sub(d);
                sizes[1] += d;
            }
            let c = Codec::ZstdBlocks {
                width: 4,
                blocks: sizes.clone(),
            };
            if let Ok(got) = decode(&bad, &c, len as u64) {
                assert_eq!(got.len(), len);
            }
            if let Ok((got, _)) = blocks_of(&bad, &c, len as u64, 4096, 1 + round * 997) {
                assert_eq!(got.len(), len);
            }
            let mut at = 0usize;
            for (i, &n) in sizes.iter().enumerate() {
                let end = (at + n as usize).min(bad.len());
                let (a, b) = block_raw_range(len as u64, i as u64);
                if let Ok(got) = dec.decode(&bad[at.min(end)..end], (b - a) as usize) {
                    assert_eq!(got.len() as u64, b - a);
                }
                at = end;
            }
        }
    }
}
