//! A reader's answer to `restore --into-parent` (the line on its stdin, and the ranges in it)
//! must never panic, and the targets it accepts must lie in the data region, in order,
//! apart, non-empty, and within the address space.
#![no_main]

use checkpoint::restore::{check_targets, parse_targets};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (u64, u64, &[u8])| {
    let (start, len, data) = input;
    let Ok(line) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(Some(answer)) = parse_targets(line, 7, "state.safetensors") else {
        return;
    };
    let end = start.saturating_add(len);
    let Ok(targets) = check_targets("state.safetensors", answer.ranges, [start, end]) else {
        return;
    };
    let mut at = start;
    for t in &targets {
        assert!(t.len > 0 && t.addr > 0);
        assert!(t.offset >= at && t.offset + t.len <= end);
        assert!(t.addr.checked_add(t.len).is_some());
        at = t.offset + t.len;
    }
});
