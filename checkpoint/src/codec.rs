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
/// slices of equal length, so the loop has no bounds checks and vectorizes; 4-byte elements
/// (float32, the commonest state), which the compiler does not vectorize well, have an SSE2
/// loop of their own on x86-64, twice as fast.
fn gather_planes(planes: &[&[u8]], w: usize, e0: usize, out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if w == 4 {
        let n = out.len() / 4;
        let p = |k: usize| &planes[k][e0..e0 + n];
        let done = gather4_sse2([p(0), p(1), p(2), p(3)], out);
        let rest = |k: usize| &p(k)[done..];
        gather_planes_portable(
            &[rest(0), rest(1), rest(2), rest(3)],
            4,
            0,
            &mut out[4 * done..],
        );
        return;
    }
    gather_planes_portable(planes, w, e0, out)
}

/// [`gather_planes`] for 4-byte elements, 16 at a time: the first `out.len() / 64 * 16`
/// elements, a count it returns. Each of `planes` holds at least `out.len() / 4` bytes.
#[cfg(target_arch = "x86_64")]
fn gather4_sse2(planes: [&[u8]; 4], out: &mut [u8]) -> usize {
    use std::arch::x86_64::{
        __m128i, _mm_loadu_si128, _mm_storeu_si128, _mm_unpackhi_epi8, _mm_unpackhi_epi16,
        _mm_unpacklo_epi8, _mm_unpacklo_epi16,
    };
    let [a, b, c, d] = planes.map(|p| p.chunks_exact(16));
    let mut n = 0;
    for ((((o, a), b), c), d) in out.chunks_exact_mut(64).zip(a).zip(b).zip(c).zip(d) {
        let load = |x: &[u8]| {
            // SAFETY: `x` is 16 bytes (`chunks_exact(16)`), and an unaligned load of 16
            // readable bytes is always sound; SSE2 is part of every x86-64.
            unsafe { _mm_loadu_si128(x.as_ptr().cast::<__m128i>()) }
        };
        let (a, b, c, d) = (load(a), load(b), load(c), load(d));
        // SAFETY: arithmetic on registers only (SSE2, part of every x86-64).
        let (ab_lo, ab_hi, cd_lo, cd_hi) = unsafe {
            (
                _mm_unpacklo_epi8(a, b),
                _mm_unpackhi_epi8(a, b),
                _mm_unpacklo_epi8(c, d),
                _mm_unpackhi_epi8(c, d),
            )
        };
        // SAFETY: as above.
        let els = unsafe {
            [
                _mm_unpacklo_epi16(ab_lo, cd_lo),
                _mm_unpackhi_epi16(ab_lo, cd_lo),
                _mm_unpacklo_epi16(ab_hi, cd_hi),
                _mm_unpackhi_epi16(ab_hi, cd_hi),
            ]
        };
        for (dst, v) in o.chunks_exact_mut(16).zip(els) {
            // SAFETY: `dst` is 16 writable bytes (`chunks_exact_mut(16)`), and an unaligned
            // store to them is always sound.
            unsafe { _mm_storeu_si128(dst.as_mut_ptr().cast::<__m128i>(), v) }
        }
        n += 16;
    }
    n
}

/// [`gather_planes`] without SIMD of its own, for every width and target.
fn gather_planes_portable(planes: &[&[u8]], w: usize, e0: usize, out: &mut [u8]) {
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
mod tests;
