//! Records parse strictly, never panic, and name the key in every error.

use elastic::Error;
use elastic::record::{
    self, CommitRecord, EpochRecord, Generation, JobState, LeaderRecord, MemberRecord, Outcome,
    RECORD_VERSION, RankedMember, RestartRecord, WaitingRecord,
};
use elastic::scaling::{OnIndivisible, ScalingConfig, ScalingMode};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

const KEY: &str = "/elastic-run/job/ctl/generation";

fn generation() -> Generation {
    let scaling = ScalingConfig {
        mode: ScalingMode::Linear,
        per_worker_batch: Some(8),
        base_world_size: 4,
        base_lr: Some(0.1),
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
                continuing: false,
            },
            RankedMember {
                node_id: "a".into(),
                addr: "10.0.0.1".into(),
                nproc: 2,
                rank_offset: 4,
                continuing: false,
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

#[test]
fn continuing_members_are_recorded_only_when_set_and_tell_who_continues_beside_a_node() {
    let mut g = generation();
    // A record written before the field (or with nobody continuing) has no `continuing`.
    let text = String::from_utf8(record::encode(&g)).unwrap();
    assert!(!text.contains("continuing"), "{text}");
    assert!(!g.continues_besides("a") && !g.continues_besides("b"));
    g.members[0].continuing = true;
    let back: Generation = record::parse(KEY, &record::encode(&g)).unwrap();
    assert!(back.members[0].continuing && !back.members[1].continuing);
    // "b" continues: "a" and a stranger have it beside them, "b" itself has no one.
    assert!(back.continues_besides("a"));
    assert!(!back.continues_besides("b"));
    assert!(back.continues_besides("z"));
    g.members[1].continuing = true;
    assert!(g.continues_besides("a") && g.continues_besides("b"));
}

#[test]
fn generations_with_unknown_scaling_values_write_null_and_old_ones_with_numbers_parse() {
    // Unknown batch and LR (no `--batch-size`, no `--base-lr`): `null` in the record.
    let mut g = generation();
    g.scaling = ScalingConfig {
        mode: ScalingMode::Sqrt,
        per_worker_batch: None,
        base_world_size: 4,
        base_lr: None,
        global_batch: None,
        on_indivisible: OnIndivisible::Nearest,
        warmup_steps: None,
    }
    .decide(6, None)
    .unwrap();
    let bytes = record::encode(&g);
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    for k in ["lr", "global_batch", "per_worker_batch"] {
        assert!(v["scaling"][k].is_null(), "{k}: {v}");
    }
    let back: Generation = record::parse(KEY, &bytes).unwrap();
    assert_eq!(back, g);
    // A generation written by a build whose scaling values were always numbers.
    let old = br#"{"version":1,"number":3,
        "members":[{"node_id":"b","addr":"10.0.0.2","nproc":4,"rank_offset":0},
                   {"node_id":"a","addr":"10.0.0.1","nproc":2,"rank_offset":4}],
        "world_size":6,"master_addr":"10.0.0.2","master_port":29500,
        "scaling":{"lr_scale":1.5,"lr":0.15,"global_batch":48,"grad_accum_steps":1,
                   "per_worker_batch":8,"warmup_steps":10,"note":""},
        "resume_step":1200,"created_unix_ms":1700000000000}"#;
    let mut old: Generation = record::parse(KEY, old).unwrap();
    let today = generation();
    let lr = old.scaling.lr.expect("a number reads as a known LR");
    assert!((lr - 0.15).abs() < 1e-12, "{lr}");
    old.scaling.lr = today.scaling.lr; // 0.1 x 1.5 need not print as 0.15
    assert_eq!(old, today, "the same generation as today's encoding");
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
        spare_master_port: None,
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

#[test]
fn member_records_without_a_spare_port_still_parse() {
    // Written by a build before the spare port existed.
    let old = br#"{"version":1,"node_id":"a","addr":"h","nproc":2,"master_port":29500,"joined_unix_ms":5}"#;
    let m: MemberRecord = record::parse("/elastic-run/job/members/a", old).unwrap();
    assert_eq!((m.master_port, m.spare_master_port), (29500, None));
}

#[test]
fn restart_records_check_node_generation_and_reason() {
    let key = "/elastic-run/job/ctl/restart/a";
    let good = RestartRecord {
        version: RECORD_VERSION,
        generation: 4,
        node_id: "a".into(),
        reason: "worker 1 exited with code 7".into(),
        requested_unix_ms: 9,
    };
    let back: RestartRecord = record::parse(key, &record::encode(&good)).unwrap();
    assert_eq!(back, good);
    type Mutation = fn(&mut RestartRecord);
    let cases: [(&str, Mutation); 3] = [
        ("generation 0", |r| r.generation = 0),
        ("node id", |r| r.node_id = "../x".into()),
        ("reason of", |r| {
            r.reason = "x".repeat(record::REASON_BYTES_MAX + 1)
        }),
    ];
    for (needle, mutate) in cases {
        let mut r = good.clone();
        mutate(&mut r);
        match record::parse::<RestartRecord>(key, &record::encode(&r)) {
            Err(Error::BadValue { reason, .. }) => assert!(reason.contains(needle), "{reason}"),
            other => panic!("{needle}: {other:?}"),
        }
    }
}

/// One valid encoding of every record kind: the seeds the mutation sweep starts from.
fn valid_records() -> Vec<Vec<u8>> {
    vec![
        record::encode(&generation()),
        record::encode(&MemberRecord {
            version: RECORD_VERSION,
            node_id: "node-7".into(),
            addr: "10.0.0.7".into(),
            nproc: 8,
            master_port: 29500,
            joined_unix_ms: 1_700_000_000_000,
            spare_master_port: Some(29501),
        }),
        record::encode(&LeaderRecord {
            version: RECORD_VERSION,
            node_id: "node-7".into(),
            lease_id: 0x7fff_ffff_ffff,
        }),
        record::encode(&CommitRecord {
            version: RECORD_VERSION,
            step: 1200,
            committed_unix_ms: 1,
            node_id: "node-7".into(),
            generation: Some(4),
        }),
        record::encode(&WaitingRecord {
            version: RECORD_VERSION,
            generation: 3,
            reason: "1 present, below min 2".into(),
            until_unix_ms: 2,
        }),
        record::encode(&JobState {
            version: RECORD_VERSION,
            outcome: Outcome::Failed,
            reason: "finished with failure".into(),
            at_unix_ms: 3,
        }),
        record::encode(&RestartRecord {
            version: RECORD_VERSION,
            generation: 3,
            node_id: "node-7".into(),
            reason: "worker failed: ünïcode".into(),
            requested_unix_ms: 4,
        }),
        record::encode(&EpochRecord {
            version: RECORD_VERSION,
            number: 12,
        }),
    ]
}

/// Bytes that JSON parsers and record checks trip on.
const TOKENS: &[&[u8]] = &[
    b"0",
    b"-1",
    b"18446744073709551616",
    b"1e999",
    b"null",
    b"true",
    b"\"\"",
    b"[",
    b"]",
    b"{",
    b"}",
    b",",
    b":",
    b"\"\\u0000\"",
    b"\"\\ud800\"",
    b"\xff",
    b"\x00",
    b"\"version\":1",
    b"\"version\":4294967296",
    b"\"members\":[]",
    b"[[[[[[[[[[[[[[[[",
];

fn mutate(rng: &mut StdRng, seeds: &[Vec<u8>], v: &mut Vec<u8>) {
    match rng.random_range(0..7) {
        0 if !v.is_empty() => {
            let i = rng.random_range(0..v.len());
            v[i] = rng.random();
        }
        1 => {
            let i = rng.random_range(0..=v.len());
            let t = TOKENS[rng.random_range(0..TOKENS.len())];
            v.splice(i..i, t.iter().copied());
        }
        2 if !v.is_empty() => {
            let a = rng.random_range(0..v.len());
            let b = rng.random_range(a..=v.len().min(a + 16));
            v.drain(a..b);
        }
        3 => v.truncate(rng.random_range(0..=v.len())),
        4 => {
            // Splice a piece of another record in: fields of one kind inside another.
            let other = &seeds[rng.random_range(0..seeds.len())];
            let a = rng.random_range(0..=other.len());
            let b = rng.random_range(a..=other.len());
            let i = rng.random_range(0..=v.len());
            v.splice(i..i, other[a..b].iter().copied());
        }
        5 => {
            // Replace a number with an extreme one.
            if let Some(i) = v.iter().position(|c| c.is_ascii_digit()) {
                let t = TOKENS[rng.random_range(0..3)];
                v.splice(i..i + 1, t.iter().copied());
            }
        }
        _ => {
            let n = rng.random_range(0..64);
            v.extend((0..n).map(|_| rng.random::<u8>()));
        }
    }
}

/// The fuzz target's property (`elastic/fuzz`, `records`) on stable: every parser of etcd
/// values returns an error or a record for random and mutated inputs, never panics. Seeded;
/// `ELASTIC_SEED=<n>` replays a failure.
#[test]
fn every_record_parser_survives_random_and_mutated_values() {
    let seed: u64 = std::env::var("ELASTIC_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let mut rng = StdRng::seed_from_u64(seed);
    let seeds = valid_records();
    for (i, v) in seeds.iter().enumerate() {
        // Unknown fields are ignored (newer writers may add some), so a record can also parse
        // as a kind with fewer fields.
        assert!(
            record::parse_every_kind(KEY, v) >= 1,
            "seed record {i} parses"
        );
    }
    let mut accepted = 0;
    for case in 0..5_000 {
        let mut v = if rng.random_bool(0.1) {
            let n = rng.random_range(0..256);
            (0..n).map(|_| rng.random::<u8>()).collect()
        } else {
            seeds[rng.random_range(0..seeds.len())].clone()
        };
        for _ in 0..rng.random_range(1..=4) {
            mutate(&mut rng, &seeds, &mut v);
        }
        let r = std::panic::catch_unwind(|| record::parse_every_kind(KEY, &v));
        match r {
            Ok(n) => accepted += n,
            Err(_) => panic!(
                "seed {seed} (ELASTIC_SEED={seed} to replay), case {case}: a parser panicked on {:?}",
                String::from_utf8_lossy(&v)
            ),
        }
    }
    // Some mutations keep a record valid (a changed digit); if none did, the sweep would only
    // test the JSON syntax errors.
    assert!(accepted > 0, "no mutated value parsed (seed {seed})");
}
