//! The agent's decision core (`runtime::agent::decide`), driven by the cases in
//! `testdata/agent_decide.json` and by a seeded sweep over every kind of input that checks
//! the rules `after_group` states.

use runtime::agent::decide::{
    Action, AfterGroup, Decision, DrainOf, Ended, FailureSeen, StopWhy, after_group, must_stop,
};
use serde::Deserialize;
use serde_json::json;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Table {
    after_group: Vec<AfterCase>,
    must_stop: Vec<StopCase>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AfterCase {
    name: String,
    input: AfterGroup,
    expect: Decision,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StopCase {
    name: String,
    /// `[number, created_unix_ms]` of the running generation and of the newest one etcd shows.
    running: (u64, u64),
    newest: Option<(u64, u64)>,
    #[serde(default)]
    waiting_for: Option<u64>,
    #[serde(default)]
    job_failed: bool,
    #[serde(default)]
    job_finished: bool,
    expect: Option<StopWhy>,
}

fn table() -> Table {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/agent_decide.json");
    let text = std::fs::read_to_string(path).expect("read testdata/agent_decide.json");
    serde_json::from_str(&text).expect("parse testdata/agent_decide.json")
}

fn generation(number: u64, created_unix_ms: u64) -> elastic::Generation {
    serde_json::from_value(json!({
        "version": 1,
        "number": number,
        "members": [{"node_id": "a", "addr": "127.0.0.1", "nproc": 1, "rank_offset": 0}],
        "world_size": 1,
        "master_addr": "127.0.0.1",
        "master_port": 29500,
        "scaling": {"lr_scale": 1.0, "lr": 0.1, "global_batch": 8, "grad_accum_steps": 1,
                    "per_worker_batch": 8, "warmup_steps": 0, "note": ""},
        "resume_step": null,
        "created_unix_ms": created_unix_ms,
    }))
    .expect("a generation record")
}

#[test]
fn after_group_table() {
    let cases = table().after_group;
    assert!(cases.len() >= 25, "the table lost cases: {}", cases.len());
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|c| {
            let got = after_group(&c.input);
            (got != c.expect).then(|| format!("{}: expected {:?}, got {:?}", c.name, c.expect, got))
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn must_stop_table_orders_generations_by_number_not_by_clock() {
    let cases = table().must_stop;
    assert!(cases.len() >= 8, "the table lost cases: {}", cases.len());
    let mut failures = Vec::new();
    for c in &cases {
        let running = generation(c.running.0, c.running.1);
        let snap = elastic::Snapshot {
            generation: c.newest.map(|(n, t)| std::sync::Arc::new(generation(n, t))),
            waiting: c.waiting_for.map(|g| elastic::record::WaitingRecord {
                version: 1,
                generation: g,
                reason: "members lost".into(),
                until_unix_ms: 0,
            }),
            job_state: (c.job_failed || c.job_finished).then(|| elastic::record::JobState {
                version: 1,
                outcome: if c.job_failed {
                    elastic::record::Outcome::Failed
                } else {
                    elastic::record::Outcome::Succeeded
                },
                reason: "a node ended the job".into(),
                at_unix_ms: 0,
            }),
            ..Default::default()
        };
        let got = must_stop(&snap, &running);
        if got != c.expect {
            failures.push(format!(
                "{}: expected {:?}, got {:?}",
                c.name, c.expect, got
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// xorshift64*: enough to cover the input space reproducibly without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize]
    }
}

fn random_input(r: &mut Rng) -> AfterGroup {
    AfterGroup {
        ended: r.pick(&[
            Ended::Succeeded,
            Ended::Drained { clean: true },
            Ended::Drained { clean: false },
            Ended::Stopped,
            Ended::Failed,
        ]),
        drain: r.pick(&[None, Some(DrainOf::Local), Some(DrainOf::Peer)]),
        peer_stop: r.below(2) == 0,
        etcd: r.below(2) == 0,
        stop_why: r.pick(&[
            None,
            Some(StopWhy::NewGeneration),
            Some(StopWhy::Fenced),
            Some(StopWhy::Waiting),
            Some(StopWhy::JobFailed),
        ]),
        failure: r.pick(&[
            FailureSeen::Unknown,
            FailureSeen::SameMembers,
            FailureSeen::MembershipChanged,
        ]),
        restarts: r.below(5) as u32,
        max_restarts: r.below(5) as u32,
    }
}

/// The rules `after_group` documents, checked for one input; returns the broken ones.
fn broken_rules(a: &AfterGroup, after_group: fn(&AfterGroup) -> Decision) -> Vec<&'static str> {
    let d = after_group(a);
    let mut broken = Vec::new();
    let mut rule = |ok: bool, what: &'static str| {
        if !ok {
            broken.push(what);
        }
    };
    let clean = matches!(a.ended, Ended::Succeeded | Ended::Drained { clean: true });
    let counted_failure = a.ended == Ended::Failed
        && a.drain.is_none()
        && (!a.etcd || a.failure == FailureSeen::SameMembers);
    rule(
        (a.drain == Some(DrainOf::Local)) == matches!(d.action, Action::Leave { .. }),
        "a local drain, and only a local drain, ends the node by leaving",
    );
    if let Action::Leave { clean: c } = d.action {
        rule(c == clean, "a drain is clean when the workers exited 0");
    }
    rule(
        !matches!(d.action, Action::Restart | Action::FailJob) || counted_failure,
        "only a failure seen with the same members counts",
    );
    rule(
        !counted_failure || matches!(d.action, Action::Restart | Action::FailJob),
        "a failure seen with the same members always counts",
    );
    rule(
        d.action != Action::Restart || a.restarts < a.max_restarts,
        "restart only below --max-restarts",
    );
    rule(
        d.action != Action::FailJob || a.restarts >= a.max_restarts,
        "fail the job only at --max-restarts",
    );
    rule(
        (d.action == Action::WatchMembership)
            == (a.ended == Ended::Failed
                && a.drain.is_none()
                && a.etcd
                && a.failure == FailureSeen::Unknown),
        "an etcd failure is looked at before it counts, and only then",
    );
    rule(
        d.action != Action::Finish || (a.ended == Ended::Succeeded && a.drain.is_none()),
        "the job finishes only when the workers finished with no drain",
    );
    if let Action::Regroup { rejoin } = d.action {
        rule(a.ended == Ended::Stopped, "only a stopped group regroups");
        rule(
            rejoin == (a.etcd && a.stop_why == Some(StopWhy::Fenced)),
            "rejoin exactly after a fence in etcd mode",
        );
    }
    if d.action == Action::WatchMembership {
        for seen in [FailureSeen::SameMembers, FailureSeen::MembershipChanged] {
            let again = after_group(&AfterGroup {
                failure: seen,
                ..*a
            });
            rule(
                again.action != Action::WatchMembership,
                "once the membership was seen, the failure is decided",
            );
            if seen == FailureSeen::MembershipChanged {
                rule(
                    again.action == Action::NextUncounted,
                    "a membership change never counts",
                );
            }
        }
    }
    let more = AfterGroup {
        restarts: a.restarts.saturating_add(1),
        ..*a
    };
    rule(
        d.action != Action::FailJob || after_group(&more).action == Action::FailJob,
        "more restarts never turn a failed job into a restart",
    );
    rule(after_group(a) == d, "the decision is deterministic");
    let round: Decision =
        serde_json::from_value(serde_json::to_value(d).expect("serialize")).expect("parse");
    rule(round == d, "a decision round-trips through its JSON form");
    broken
}

#[test]
fn after_group_sweep_keeps_its_rules() {
    let mut failures = Vec::new();
    for seed in 1..=5_000u64 {
        let mut r = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let a = random_input(&mut r);
        for what in broken_rules(&a, after_group) {
            failures.push(format!(
                "seed {seed}: {what}: {a:?} -> {:?}",
                after_group(&a)
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} broken:\n{}",
        failures.len(),
        failures[..failures.len().min(20)].join("\n")
    );
}

/// The sweep must be able to fail: decisions with a rule broken on purpose are caught.
#[test]
fn the_sweep_catches_broken_rules() {
    fn restarts_past_the_limit(a: &AfterGroup) -> Decision {
        let mut d = after_group(a);
        if d.action == Action::FailJob {
            d.action = Action::Restart;
        }
        d
    }
    fn counts_a_membership_change(a: &AfterGroup) -> Decision {
        let mut d = after_group(a);
        if a.failure == FailureSeen::MembershipChanged && d.action == Action::NextUncounted {
            d.action = Action::Restart;
        }
        d
    }
    fn restarts_without_looking(a: &AfterGroup) -> Decision {
        let mut d = after_group(a);
        if d.action == Action::WatchMembership {
            d.action = Action::Restart;
        }
        d
    }
    for (name, mutant) in [
        (
            "restarts past the limit",
            restarts_past_the_limit as fn(&AfterGroup) -> Decision,
        ),
        ("counts a membership change", counts_a_membership_change),
        ("restarts without looking", restarts_without_looking),
    ] {
        let caught = (1..=5_000u64).any(|seed| {
            let mut r = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
            !broken_rules(&random_input(&mut r), mutant).is_empty()
        });
        assert!(caught, "the sweep misses a decision that {name}");
    }
}
