//! Structured round trip: every input encodes and decodes back to itself with every plane
//! width; decoding arbitrary bytes under an arbitrary codec never panics.
#![no_main]

use arbitrary::Arbitrary;
use checkpoint::codec::{Codec, PlaneEntry, decode, encode};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input {
    data: Vec<u8>,
    width: u8,
    compress: bool,
    garbage: Vec<u8>,
    planes: Vec<(bool, u16)>,
    raw_bytes: u16,
    kind: u8,
}

fuzz_target!(|i: Input| {
    let width = [None, Some(2), Some(4), Some(8), Some(i.width)][usize::from(i.width % 5)];
    let (stored, codec) = encode(&i.data, width, i.compress);
    assert_eq!(decode(&stored, &codec, i.data.len() as u64).unwrap(), i.data);

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
    let _ = decode(&i.garbage, &codec, u64::from(i.raw_bytes));
});
