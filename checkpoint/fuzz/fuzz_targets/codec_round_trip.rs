//! Structured round trip: every input encodes and decodes back to itself with every plane
//! width, by this build's encoder and format 2's, whole and in blocks from stored bytes that
//! arrive in pieces of any size (with the blocks' checksum that of the input, and, summed by
//! check block, every sum the manifest would hold: stored, decoded and per block), and each
//! `zstd-blocks` block alone from its stored bytes; decoding arbitrary bytes under an
//! arbitrary codec, whole or in pieces and blocks or one `zstd-blocks` block, summed whole or
//! by check block, never panics, and where they succeed they agree.
#![no_main]

use arbitrary::Arbitrary;
use checkpoint::codec::{
    BlockDecoder, ChunkDecoder, Codec, PlaneEntry, block_raw_range, decode, decode_blocks,
    encode, encode_format2,
};
use checkpoint::format::BlockCrcs;
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input {
    data: Vec<u8>,
    width: u8,
    compress: bool,
    garbage: Vec<u8>,
    planes: Vec<(bool, u16)>,
    raw_bytes: u16,
    piece: u16,
    kind: u8,
}

fuzz_target!(|i: Input| {
    let width = [None, Some(2), Some(4), Some(8), Some(i.width)][usize::from(i.width % 5)];
    let block = 1 + usize::from(i.raw_bytes % 512);
    let piece = 1 + usize::from(i.piece);
    let n = i.data.len() as u64;
    for enc in [encode, encode_format2] {
        let (stored, codec) = enc(&i.data, width, i.compress);
        assert_eq!(decode(&stored, &codec, n).unwrap(), i.data);
        let (got, crc) = blocks(&stored, &codec, n, block, piece).unwrap();
        assert_eq!(got, i.data);
        assert_eq!(crc, crc32c::crc32c(&i.data));
        let (got, sums) = summed_by_block(&stored, &codec, n, block, piece).unwrap();
        assert_eq!(got, i.data);
        let mut want = BlockCrcs::default();
        want.push(&i.data);
        let (decoded, per_block) = want.finish();
        assert_eq!(sums.decoded, decoded);
        assert_eq!(sums.blocks, Some(per_block));
        // Summed by block, only a raw chunk's stored bytes have a sum (its decoded one).
        let raw = codec == Codec::Raw;
        assert_eq!(sums.stored, raw.then(|| crc32c::crc32c(&stored)));
        if let Codec::ZstdBlocks { width, .. } = &codec {
            let mut dec = BlockDecoder::new(*width).unwrap();
            for (b, (s0, s1)) in codec.stored_blocks(n).unwrap().into_iter().enumerate() {
                let (r0, r1) = block_raw_range(n, b as u64);
                let got = dec.decode(&stored[s0 as usize..s1 as usize], (r1 - r0) as usize);
                assert_eq!(got.unwrap(), &i.data[r0 as usize..r1 as usize]);
            }
        }
    }

    let lens = || i.planes.iter().map(|(_, n)| u64::from(*n));
    let raw_bytes = if i.kind % 4 == 3 {
        // Up to three blocks of `zstd-blocks`.
        u64::from(i.raw_bytes) * 12
    } else {
        u64::from(i.raw_bytes)
    };
    let codec = match i.kind % 4 {
        0 => Codec::Raw,
        1 => Codec::Zstd,
        3 => Codec::ZstdBlocks {
            width: i.width,
            blocks: lens().collect(),
        },
        _ => Codec::ZstdPlanes {
            width: i.width,
            planes: i
                .planes
                .iter()
                .map(|(z, n)| PlaneEntry { zstd: *z, stored_bytes: u64::from(*n) })
                .collect(),
        },
    };
    let whole = decode(&i.garbage, &codec, raw_bytes);
    let streamed = blocks(&i.garbage, &codec, raw_bytes, block, piece);
    let by_block = summed_by_block(&i.garbage, &codec, raw_bytes, block, piece);
    if let (Ok(a), Ok((b, _))) = (&whole, &streamed) {
        assert_eq!(a, b);
    }
    if let (Ok((a, crc)), Ok((b, sums))) = (&streamed, &by_block) {
        assert_eq!(a, b);
        assert_eq!(*crc, sums.decoded);
        let raw = codec == Codec::Raw;
        assert_eq!(sums.stored, raw.then(|| crc32c::crc32c(&i.garbage)));
    }
    // One block of arbitrary stored bytes, as a ranged read decodes it before its checksum.
    if let Ok(mut dec) = BlockDecoder::new(i.width) {
        if let Ok(got) = dec.decode(&i.garbage, usize::from(i.raw_bytes)) {
            assert_eq!(got.len(), usize::from(i.raw_bytes));
        }
    }
});

/// Every block `decode_blocks` hands over, in order, and their checksum.
fn blocks(
    stored: &[u8],
    codec: &Codec,
    raw: u64,
    block: usize,
    piece: usize,
) -> Result<(Vec<u8>, u32), ()> {
    let mut out = Vec::new();
    let crc = decode_blocks(stored, codec, raw, block, piece, |at, b| {
        assert_eq!(at, out.len() as u64);
        out.extend_from_slice(b);
        Ok::<_, ()>(())
    })
    .map_err(|_| ())?;
    Ok((out, crc))
}

/// Every block a [`ChunkDecoder`] summing by check block hands over, in order, and the
/// checksums it returns.
fn summed_by_block(
    stored: &[u8],
    codec: &Codec,
    raw: u64,
    block: usize,
    piece: usize,
) -> Result<(Vec<u8>, checkpoint::codec::Checksums), ()> {
    let mut d = ChunkDecoder::new(codec, raw, stored.len() as u64, block).map_err(|_| ())?;
    d.sum_blocks();
    let mut out = Vec::new();
    let mut sink = |at: u64, b: &[u8]| {
        assert_eq!(at, out.len() as u64);
        out.extend_from_slice(b);
        Ok::<_, ()>(())
    };
    for p in stored.chunks(piece) {
        d.push(bytes::Bytes::copy_from_slice(p), &mut sink)
            .map_err(|_| ())?;
    }
    let sums = d.finish(&mut sink).map_err(|_| ())?;
    Ok((out, sums))
}
