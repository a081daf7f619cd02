//! Per-chunk compression: `raw`, `zstd`, or `zstd-planes`.
//!
//! `zstd-planes` splits the aligned prefix of a chunk into `width` byte planes (plane `k`
//! holds byte `k` of every element), compresses each plane that shrinks and keeps the others
//! raw, then appends the unaligned tail raw. On float weights the exponent planes compress
//! well while mantissa planes are noise, which plain zstd cannot see.
//!
//! The choice is made per chunk; a chunk is stored raw when compression does not pay.

use serde::{Deserialize, Serialize};

mod stream;
pub use stream::ChunkDecoder;

/// zstd level used for chunks: level 1 is the speed/ratio sweet spot on weights.
pub const ZSTD_LEVEL: i32 = 1;
/// A compressed form is kept only when it is at most this fraction of the input (in 1/1000).
const PAYS_PER_MILLE: usize = 970;

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
    ZstdPlanes { width: u8, planes: Vec<PlaneEntry> },
}

impl Codec {
    pub fn name(&self) -> &'static str {
        match self {
            Codec::Raw => "raw",
            Codec::Zstd => "zstd",
            Codec::ZstdPlanes { .. } => "zstd-planes",
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
/// if any; `compress == false` stores raw.
pub fn encode(raw: &[u8], plane_width: Option<u8>, compress: bool) -> (Vec<u8>, Codec) {
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
    Ok(d.finish(&mut sink)?.1)
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
                    let (stored, codec) = encode(&data, width, compress);
                    let back = decode(&stored, &codec, len as u64).unwrap();
                    assert_eq!(back, data, "{dtype} len {len} codec {codec:?}");
                }
            }
        }
    }

    /// Every block `decode_blocks` hands over, put together, with its crc32c.
    fn blocks(
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
                for (input, compress) in [(&data, false), (&data, true), (&zeros, true)] {
                    let (stored, codec) = encode(input, width, compress);
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
                                blocks(&stored, &codec, len as u64, block, piece).unwrap();
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

    #[test]
    fn decode_blocks_refuses_damaged_or_mislabelled_chunks_and_stops_at_a_refusing_sink() {
        let data = weights(20_000, 4, 5);
        let (stored, codec) = encode(&data, Some(4), true);
        assert_eq!(codec.name(), "zstd-planes");
        let n = data.len() as u64;
        assert!(blocks(&stored, &codec, n + 1, 4096, 100).is_err());
        assert!(blocks(&stored[..stored.len() - 1], &codec, n, 4096, 100).is_err());
        let mut bad = stored.clone();
        bad[10] ^= 0xff;
        if let Ok((got, crc)) = blocks(&bad, &codec, n, 4096, 100) {
            assert!(got != data && crc != crc32c::crc32c(&data));
        }
        let zeros = vec![0u8; 50_000];
        let (z, zc) = encode(&zeros, None, true);
        assert_eq!(zc, Codec::Zstd);
        let short = blocks(&z, &zc, 50_001, 4096, 100).unwrap_err();
        assert!(short.contains("ends before"), "{short}");
        let long = blocks(&z, &zc, 49_999, 4096, 100).unwrap_err();
        assert!(long.contains("more than"), "{long}");
        assert!(blocks(&z[..z.len() / 2], &zc, 50_000, 4096, 100).is_err());
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
        let (stored, codec) = encode(&data, Some(4), true);
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
                let r = blocks(&bad, &bad_codec, data.len() as u64, 4096, piece);
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
            let err = blocks(&stored, &codec, 4000, 4096, piece).unwrap_err();
            assert!(err.contains("plane 0"), "{err}");
        }
    }

    #[test]
    fn planes_beat_plain_zstd_on_bf16_weights_and_random_bytes_stay_raw() {
        let data = weights(1 << 16, 2, 1);
        let (stored, codec) = encode(&data, Some(2), true);
        assert_eq!(codec.name(), "zstd-planes");
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
        let zeros = vec![0u8; 10_000];
        assert_eq!(encode(&zeros, None, true).1, Codec::Zstd);
    }

    #[test]
    fn large_chunks_take_the_probe_path_and_still_round_trip() {
        let mut data = weights(1 << 20, 4, 9);
        data.push(7); // odd tail
        let (stored, codec) = encode(&data, Some(4), true);
        let Codec::ZstdPlanes { planes, .. } = &codec else {
            panic!("{codec:?}")
        };
        assert!(planes[3].zstd, "the exponent plane compresses");
        assert_eq!(decode(&stored, &codec, data.len() as u64).unwrap(), data);
    }

    #[test]
    fn decode_rejects_inconsistent_lengths_without_panicking() {
        let data = weights(1000, 4, 2);
        let (stored, codec) = encode(&data, Some(4), true);
        assert!(decode(&stored, &codec, 4001).is_err());
        assert!(decode(&stored[..stored.len() - 1], &codec, 4000).is_err());
        let (z, zc) = encode(&vec![0u8; 5000], None, true);
        assert!(decode(&z, &zc, 4999).is_err());
        assert!(decode(&z, &zc, 5001).is_err());
        assert!(decode(b"garbage!", &Codec::Zstd, 8).is_err());
        let bad = Codec::ZstdPlanes {
            width: 3,
            planes: vec![],
        };
        assert!(decode(b"", &bad, 0).is_err());
    }
}
