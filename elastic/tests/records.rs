//! Records parse strictly, never panic, and name the key in every error.

use elastic::Error;
use elastic::record::{self, Generation, MemberRecord, RECORD_VERSION, RankedMember};
use elastic::scaling::{OnIndivisible, ScalingConfig, ScalingMode};

const KEY: &str = "/elastic-run/job/ctl/generation";

fn generation() -> Generation {
    let scaling = ScalingConfig {
        mode: ScalingMode::Linear,
        per_worker_batch: 8,
        base_world_size: 4,
        base_lr: 0.1,
        global_batch: None,
        on_indivisible: OnIndivisible::Nearest,
        warmup_steps: Some(10),
    }
    .decide(6, Some(4))
    .unwrap();
    Generation {
        version: RECORD_VERSION,
        number: 3,
        members: vec![
            RankedMember {
                node_id: "b".into(),
                addr: "10.0.0.2".into(),
                nproc: 4,
                rank_offset: 0,
            },
            RankedMember {
                node_id: "a".into(),
                addr: "10.0.0.1".into(),
                nproc: 2,
                rank_offset: 4,
            },
        ],
        world_size: 6,
        master_addr: "10.0.0.2".into(),
        master_port: 29500,
        scaling,
        resume_step: Some(1200),
        created_unix_ms: 1_700_000_000_000,
    }
}

#[test]
fn generation_round_trips() {
    let g = generation();
    let back: Generation = record::parse(KEY, &record::encode(&g)).unwrap();
    assert_eq!(back, g);
    assert_eq!(
        back.member("a").map(|(rank, m)| (rank, m.rank_offset)),
        Some((1, 4))
    );
}

fn expect_bad(value: &[u8], needle: &str) {
    match record::parse::<Generation>(KEY, value) {
        Err(Error::BadValue { key, reason }) => {
            assert_eq!(key, KEY);
            assert!(reason.contains(needle), "{reason:?} lacks {needle:?}");
            // The message a user sees names the key.
            let msg = Error::BadValue { key, reason }.to_string();
            assert!(msg.contains(KEY));
        }
        other => panic!(
            "expected BadValue for {:?}, got {other:?}",
            String::from_utf8_lossy(value)
        ),
    }
}

#[test]
fn garbage_is_a_bad_value_naming_the_key() {
    expect_bad(b"", "not a versioned JSON record");
    expect_bad(b"\xff\xfe", "not a versioned JSON record");
    expect_bad(b"{\"version\":1}", "missing field");
    expect_bad(b"[1,2,3]", "not a versioned JSON record");
    expect_bad(&vec![b' '; record::RECORD_BYTES_MAX + 1], "bytes, over");
}

#[test]
fn unknown_version_is_reported_as_such() {
    let mut v: serde_json::Value = serde_json::to_value(generation()).unwrap();
    v["version"] = 2.into();
    match record::parse::<Generation>(KEY, &serde_json::to_vec(&v).unwrap()) {
        Err(Error::UnsupportedVersion {
            key,
            found: 2,
            supported: 1,
        }) => assert_eq!(key, KEY),
        other => panic!("{other:?}"),
    }
}

#[test]
fn inconsistent_generations_are_rejected() {
    type Mutation = fn(&mut Generation);
    let cases: [(&str, Mutation); 7] = [
        ("world size", |g| g.world_size = 7),
        ("rank offset", |g| g.members[1].rank_offset = 3),
        ("listed twice", |g| g.members[1].node_id = "b".into()),
        ("no members", |g| g.members.clear()),
        ("master address", |g| g.master_addr = "10.0.0.1".into()),
        ("nproc 0", |g| g.members[1].nproc = 0),
        ("node id", |g| g.members[1].node_id = "a/b".into()),
    ];
    for (needle, mutate) in cases {
        let mut g = generation();
        mutate(&mut g);
        expect_bad(&record::encode(&g), needle);
    }
}

#[test]
fn member_record_checks_node_id_and_nproc() {
    let key = "/elastic-run/job/members/a";
    let m = MemberRecord {
        version: RECORD_VERSION,
        node_id: "a".into(),
        addr: "h".into(),
        nproc: 0,
        master_port: 1,
        joined_unix_ms: 0,
    };
    assert!(matches!(
        record::parse::<MemberRecord>(key, &record::encode(&m)),
        Err(Error::BadValue { .. })
    ));
}

/// A cheap must-not-panic sweep: every truncation and single-byte corruption of a valid
/// record parses or fails cleanly.
#[test]
fn truncated_and_corrupted_values_never_panic() {
    let good = record::encode(&generation());
    for len in 0..good.len() {
        let _ = record::parse::<Generation>(KEY, &good[..len]);
    }
    for i in 0..good.len() {
        for b in [b'0', b'"', b'}', b'-', 0xff] {
            let mut v = good.clone();
            v[i] = b;
            let _ = record::parse::<Generation>(KEY, &v);
        }
    }
}
