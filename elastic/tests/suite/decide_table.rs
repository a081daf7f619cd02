//! Drives the pure decision core with the cases in `testdata/decide.json`.

use elastic::core::{
    CommitInfo, CoreConfig, Decision, Input, JoinPolicy, MemberState, Observed, Regroup, Timing,
    Tracker, decide,
};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Case {
    name: String,
    #[serde(default)]
    min: Option<u32>,
    #[serde(default)]
    max: Option<u32>,
    #[serde(default)]
    policy: Option<JoinPolicy>,
    now: u64,
    members: Vec<(String, MemberState, u64)>,
    #[serde(default)]
    current: Option<Vec<String>>,
    /// `[step, at]`
    #[serde(default)]
    commit: Option<(u64, u64)>,
    #[serde(default)]
    changed_at: u64,
    #[serde(default)]
    below_min_since: Option<u64>,
    /// The current generation's number.
    #[serde(default)]
    number: u64,
    /// The newest generation a member asked to restart.
    #[serde(default)]
    restart_for: Option<u64>,
    /// The generation that saved the newest commit, when known.
    #[serde(default)]
    commit_generation: Option<u64>,
    /// The step the current generation resumes from.
    #[serde(default)]
    resume: Option<u64>,
    /// A regroup of the current generation: `[since_ms, [confirmed...]]`.
    #[serde(default)]
    regroup: Option<(u64, Vec<String>)>,
    /// The generation the regroup names (default: the current one).
    #[serde(default)]
    regroup_generation: Option<u64>,
    /// Members left out of a regroup lately.
    #[serde(default)]
    excluded: Vec<String>,
    /// Members of the current generation seen draining.
    #[serde(default)]
    drained: Vec<String>,
    expect: Decision,
}

/// The defaults every case starts from: 2..=4 nodes, 1 s settle, 10 s below-min timeout.
fn config(case: &Case) -> CoreConfig {
    CoreConfig {
        min_nodes: case.min.unwrap_or(2),
        max_nodes: case.max.unwrap_or(4),
        settle_ms: 1_000,
        join_policy: case.policy.unwrap_or(JoinPolicy::Immediate),
        below_min_timeout_ms: 10_000,
        confirm_window_ms: 500,
    }
}

#[test]
fn decision_table() {
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/decide.json"))
            .expect("read testdata/decide.json");
    let cases: Vec<Case> = serde_json::from_str(&text).expect("parse testdata/decide.json");
    assert!(cases.len() >= 25, "the table lost cases: {}", cases.len());
    let mut failures = Vec::new();
    for case in &cases {
        let cfg = config(case);
        cfg.validate().expect("valid config");
        let input = Input {
            now_ms: case.now,
            members: case
                .members
                .iter()
                .map(|(id, state, joined)| Observed {
                    node_id: id.clone(),
                    state: *state,
                    joined_at: *joined,
                })
                .collect(),
            current: case.current.clone(),
            last_commit: case.commit.map(|(step, at)| CommitInfo {
                step,
                at,
                generation: case.commit_generation,
            }),
            timing: Timing {
                changed_at_ms: case.changed_at,
                below_min_since_ms: case.below_min_since,
            },
            current_number: case.number,
            restart_requested_for: case.restart_for,
            current_resume_step: case.resume,
            regroup: case.regroup.as_ref().map(|(since_ms, confirmed)| Regroup {
                generation: case.regroup_generation.unwrap_or(case.number),
                since_ms: *since_ms,
                confirmed: confirmed.clone(),
            }),
            excluded: case.excluded.clone(),
            drained: case.drained.clone(),
        };
        let got = decide(&cfg, &input);
        if got != case.expect {
            failures.push(format!(
                "{}:\n  expected {:?}\n  got      {:?}",
                case.name, case.expect, got
            ));
        }
        // Same input, same answer: the core keeps no hidden state.
        assert_eq!(
            decide(&cfg, &input),
            got,
            "{} is not deterministic",
            case.name
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_reason_has_a_message() {
    let cfg = CoreConfig {
        min_nodes: 1,
        max_nodes: 2,
        settle_ms: 0,
        join_policy: JoinPolicy::Immediate,
        below_min_timeout_ms: 0,
        confirm_window_ms: 0,
    };
    let input = Input {
        now_ms: 0,
        members: vec![],
        current: None,
        last_commit: None,
        timing: Timing::default(),
        current_number: 0,
        restart_requested_for: None,
        current_resume_step: None,
        regroup: None,
        excluded: vec![],
        drained: vec![],
    };
    let d = decide(&cfg, &input);
    assert!(matches!(d, Decision::Fail { .. }), "{d:?}");
    assert!(d.reason().to_string().contains("below min"));
}

#[test]
fn config_rejects_bad_ranges() {
    let mut cfg = CoreConfig {
        min_nodes: 0,
        max_nodes: 2,
        settle_ms: 0,
        join_policy: JoinPolicy::Immediate,
        below_min_timeout_ms: 0,
        confirm_window_ms: 0,
    };
    assert!(cfg.validate().is_err());
    cfg.min_nodes = 3;
    assert!(cfg.validate().is_err());
    cfg.min_nodes = 1;
    cfg.join_policy = JoinPolicy::Waiting(0);
    assert!(cfg.validate().is_err());
    cfg.join_policy = JoinPolicy::Waiting(1);
    assert!(cfg.validate().is_ok());
}

fn obs(id: &str, state: MemberState) -> Observed {
    Observed {
        node_id: id.into(),
        state,
        joined_at: 0,
    }
}

#[test]
fn tracker_moves_changed_at_only_on_membership_changes() {
    let mut t = Tracker::new();
    let ab = [obs("a", MemberState::Alive), obs("b", MemberState::Alive)];
    assert_eq!(t.observe(100, &ab, &[], 2).changed_at_ms, 100);
    assert_eq!(t.observe(200, &ab, &[], 2).changed_at_ms, 100, "same view");
    let ab_drain = [
        obs("a", MemberState::Alive),
        obs("b", MemberState::Draining),
    ];
    let timing = t.observe(300, &ab_drain, &[], 2);
    assert_eq!(timing.changed_at_ms, 300, "a state change is a change");
    assert_eq!(
        timing.below_min_since_ms,
        Some(300),
        "draining is not eligible"
    );
    assert_eq!(
        t.observe(400, &ab_drain, &[], 2).below_min_since_ms,
        Some(300),
        "keeps the first time"
    );
    let timing = t.observe(500, &ab, &[], 2);
    assert_eq!(timing.below_min_since_ms, None, "back at min");
    assert_eq!(timing.changed_at_ms, 500);
    // A member left out of a regroup is still registered until its lease lapses, but it is
    // not eligible: the time below min starts when it is left out.
    let timing = t.observe(600, &ab, &["b".to_string()], 2);
    assert_eq!(
        timing.below_min_since_ms,
        Some(600),
        "excluded is not eligible"
    );
    assert_eq!(timing.changed_at_ms, 500, "the same members");
}
