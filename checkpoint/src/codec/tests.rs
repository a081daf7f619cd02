//! The codecs' unit tests: round trips through every codec and plane width, decoding in
//! pieces and blocks, block checksums, and bytes that must be refused.

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
fn gathered_planes_are_the_elements_they_came_from_at_every_length_and_offset() {
    for w in [2usize, 4, 8] {
        let elems = 300;
        let data = weights(elems, w as u8, 3);
        let planes: Vec<Vec<u8>> = (0..w)
            .map(|k| {
                let mut p = vec![0u8; elems];
                extract_plane(&data, w, k, &mut p);
                p
            })
            .collect();
        let views: Vec<&[u8]> = planes.iter().map(|p| &p[..]).collect();
        // Lengths around the 16-element SIMD step, from offsets that misalign it.
        for e0 in [0usize, 1, 7, 16, 33] {
            for n in (0..=elems - e0).filter(|&n| n % 16 < 3 || n % 16 > 13 || n < 40) {
                let mut out = vec![0xa5u8; n * w];
                gather_planes(&views, w, e0, &mut out);
                assert_eq!(out, &data[e0 * w..(e0 + n) * w], "w {w} e0 {e0} n {n}");
            }
        }
    }
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
/// stored checksum is the same as when summed whole, except that a compressed chunk summed by
/// block has none unless kept: its block sums cover every decoded byte.
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
        for (by_block, keep) in [(false, false), (true, false), (true, true)] {
            for piece in [1000usize, 65_536, usize::MAX] {
                let mut d =
                    ChunkDecoder::new(&codec, len as u64, stored.len() as u64, 1 << 16).unwrap();
                if by_block {
                    d.sum_blocks();
                }
                if keep {
                    d.keep_stored_sum();
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
                let what = format!("{codec:?} by block {by_block} keep {keep} piece {piece}");
                assert_eq!(out, data, "{what}");
                let blocks = by_block.then_some(&want_blocks[..]);
                assert_eq!(sums.blocks.as_deref(), blocks, "{what}");
                assert_eq!(sums.decoded, crc32c::crc32c(&data), "{what}");
                // Summed by block, a compressed chunk's stored bytes get no pass of their own,
                // unless kept.
                let stored_sum = (!by_block || !compress || keep).then(|| crc32c::crc32c(&stored));
                assert_eq!(sums.stored, stored_sum, "{what}");
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
