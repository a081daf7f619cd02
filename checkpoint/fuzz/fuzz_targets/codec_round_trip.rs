//! Structured round trip: every input encodes and decodes back to itself with every plane
//! width, whole and in blocks from stored bytes that arrive in pieces of any size (with the
//! blocks' checksum that of the input); decoding arbitrary bytes under an arbitrary codec,
//! whole or in pieces and blocks, never panics, and where both succeed they agree.
#![no_main]

use arbitrary::Arbitrary;
use checkpoint::codec::{Codec, PlaneEntry, decode, decode_blocks, encode};
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
    let (stored, codec) = encode(&i.data, width, i.compress);
    assert_eq!(decode(&stored, &codec, i.data.len() as u64).unwrap(), i.data);
    let block = 1 + usize::from(i.raw_bytes % 512);
    let piece = 1 + usize::from(i.piece);
    let (got, crc) = blocks(&stored, &codec, i.data.len() as u64, block, piece).unwrap();
    assert_eq!(got, i.data);
    assert_eq!(crc, crc32c::crc32c(&i.data));

    let codec = match i.kind % 3 {
        0 => Codec::Raw,
        1 => Codec::Zstd,
        _ => Codec::ZstdPlanes {
            width: i.width,
            planes: i
                .planes
                .iter()
                .map(|(z, n)| PlaneEntry { zstd: *z, stored_bytes: u64::from(*n) })
                .collect(),
        },
    };
    let whole = decode(&i.garbage, &codec, u64::from(i.raw_bytes));
    let streamed = blocks(&i.garbage, &codec, u64::from(i.raw_bytes), block, piece);
    if let (Ok(a), Ok((b, _))) = (whole, streamed) {
        assert_eq!(a, b);
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
