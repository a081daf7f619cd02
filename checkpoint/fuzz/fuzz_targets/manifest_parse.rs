//! Manifest and part-record parsing must never panic, whatever the bytes.
#![no_main]

use checkpoint::format::{Manifest, PartRecord};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let step = data.first().copied().unwrap_or(0) as u64;
    if let Ok(m) = Manifest::parse(data, step) {
        // Whatever parses must also validate, and re-serialize to something that parses.
        assert!(m.validate(step).is_ok());
        let again = serde_json::to_vec(&m).unwrap();
        assert_eq!(Manifest::parse(&again, step).unwrap(), m);
    }
    let _ = PartRecord::parse(data, step);
});
