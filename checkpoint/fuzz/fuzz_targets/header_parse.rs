//! The safetensors header reader must never panic, and what it accepts must round-trip.
#![no_main]

use checkpoint::header::{header_len, parse_header, write_header};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() >= 8 {
        let prefix: [u8; 8] = data[..8].try_into().unwrap();
        if let Ok(n) = header_len(prefix, "fuzz", data.len() as u64) {
            let _ = parse_header(&data[8..8 + n as usize], "fuzz");
        }
    }
    if let Ok(h) = parse_header(data, "fuzz") {
        let written = write_header(&h.tensors, &h.metadata);
        let back = parse_header(&written[8..], "fuzz").expect("written header parses");
        assert_eq!(back, h);
    }
});
