//! Seeded random sweep over the decision core: whatever the input, the decision keeps the
//! invariants the agent relies on. A failure prints the seed; `ELASTIC_SEED=<n>` replays it.

use std::collections::BTreeSet;

use elastic::core::{
    CommitInfo, CoreConfig, Decision, Input, JoinPolicy, MemberState, Observed, Reason, Regroup,
    Timing, decide,
};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

const CASES: usize = 20_000;

fn random_case(rng: &mut StdRng) -> (CoreConfig, Input) {
    let min = rng.random_range(1..=4);
    let max = rng.random_range(min..=6);
    let policy = match rng.random_range(0..3) {
        0 => JoinPolicy::Immediate,
        1 => JoinPolicy::AfterCommit,
        _ => JoinPolicy::Waiting(rng.random_range(1..=3)),
    };
    let cfg = CoreConfig {
        min_nodes: min,
        max_nodes: max,
        settle_ms: rng.random_range(0..=2_000),
        join_policy: policy,
        below_min_timeout_ms: rng.random_range(0..=5_000),
        confirm_window_ms: rng.random_range(0..=1_000),
    };
    let ids = ["a", "b", "c", "d", "e", "f", "g", "h"];
    let mut members = Vec::new();
    for id in ids {
        if rng.random_bool(0.6) {
            members.push(Observed {
                node_id: id.to_string(),
                state: if rng.random_bool(0.15) {
                    MemberState::Draining
                } else {
                    MemberState::Alive
                },
                joined_at: rng.random_range(0..100),
            });
        }
    }
    let current = if rng.random_bool(0.7) {
        let mut c: Vec<String> = ids
            .iter()
            .filter(|_| rng.random_bool(0.5))
            .map(|s| s.to_string())
            .collect();
        // Any order: rank order is not alphabetical.
        for i in (1..c.len()).rev() {
            c.swap(i, rng.random_range(0..=i));
        }
        c.truncate(max as usize);
        (!c.is_empty()).then_some(c)
    } else {
        None
    };
    let now_ms = rng.random_range(0..10_000);
    let input = Input {
        now_ms,
        members,
        current,
        last_commit: rng.random_bool(0.5).then(|| CommitInfo {
            step: rng.random_range(0..1000),
            at: rng.random_range(0..100),
            generation: rng.random_bool(0.5).then(|| rng.random_range(0..=6)),
        }),
        timing: Timing {
            changed_at_ms: rng.random_range(0..=now_ms),
            below_min_since_ms: rng.random_bool(0.5).then(|| rng.random_range(0..=now_ms)),
        },
        current_number: 0,
        restart_requested_for: None,
        current_resume_step: None,
        regroup: None,
        excluded: vec![],
        drained: vec![],
    };
    let mut input = input;
    // Some present members left out of a regroup lately.
    input.excluded = input
        .members
        .iter()
        .filter(|_| rng.random_bool(0.1))
        .map(|m| m.node_id.clone())
        .collect();
    if input.current.is_some() {
        input.current_number = rng.random_range(1..=5);
        // Requests for the current generation, stale ones and (impossible, but harmless) newer ones.
        input.restart_requested_for = match rng.random_range(0..10) {
            0..=1 => Some(input.current_number),
            2 => Some(input.current_number - 1).filter(|g| *g > 0),
            3 => Some(input.current_number + 1),
            _ => None,
        };
        input.current_resume_step = rng.random_bool(0.7).then(|| rng.random_range(0..1000));
        // A regroup of the current generation (or a stale one), confirmed by some members.
        if rng.random_bool(0.3) {
            let generation = if rng.random_bool(0.8) {
                input.current_number
            } else {
                input.current_number - 1
            };
            input.regroup = Some(Regroup {
                generation,
                since_ms: rng.random_range(0..=now_ms),
                confirmed: ids
                    .iter()
                    .filter(|_| rng.random_bool(0.7))
                    .map(|s| s.to_string())
                    .collect(),
            });
        }
    }
    (cfg, input)
}

fn check(cfg: &CoreConfig, input: &Input, d: &Decision) -> Result<(), String> {
    if let Reason::StaleResume {
        resume, committed, ..
    } = d.reason()
    {
        let c = input.last_commit.ok_or("a stale resume without a commit")?;
        let by = c
            .generation
            .ok_or("a stale resume for a commit of no known generation")?;
        if by >= input.current_number || resume.is_some_and(|r| r >= *committed) {
            return Err(format!(
                "stale resume for a commit of generation {by} (current {}) at step {committed} (resume {resume:?})",
                input.current_number
            ));
        }
        let Decision::Freeze { members, .. } = d else {
            return Err("a stale resume that is not a freeze".into());
        };
        // Nobody is dropped: the same generation, resuming from a newer step.
        for id in input.current.iter().flatten() {
            if !members.contains(id) {
                return Err(format!("stale resume dropped the member {id}"));
            }
        }
    }
    let restart_current =
        input.current.is_some() && input.restart_requested_for == Some(input.current_number);
    if matches!(d.reason(), Reason::RestartRequested { .. }) {
        if !restart_current {
            return Err("restarted for a stale (or no) request".into());
        }
        let Decision::Freeze { members, .. } = d else {
            return Err("a restart that is not a freeze".into());
        };
        // Every alive member of the current generation is kept: a restart drops nobody.
        for id in input.current.iter().flatten() {
            let alive = input
                .members
                .iter()
                .any(|o| &o.node_id == id && o.state == MemberState::Alive);
            if alive && !members.contains(id) {
                return Err(format!("restart dropped the alive member {id}"));
            }
        }
    }
    let regroup_current = input
        .regroup
        .as_ref()
        .filter(|r| input.current.is_some() && r.generation == input.current_number);
    if let Reason::CollectiveFailed { left_out, .. } = d.reason() {
        let r = regroup_current.ok_or("re-formed for a stale (or no) regroup")?;
        let Decision::Freeze { members, .. } = d else {
            return Err("a regroup that is not a freeze".into());
        };
        for id in input.current.iter().flatten() {
            if members.contains(id) && !r.confirmed.contains(id) {
                return Err(format!("kept {id}, which did not confirm"));
            }
        }
        for id in left_out {
            if r.confirmed.contains(id) || members.contains(id) {
                return Err(format!("left out {id}, which confirmed (or kept it)"));
            }
        }
        if !left_out.is_empty() && input.now_ms < r.since_ms + cfg.confirm_window_ms {
            return Err("left members out before the confirmation window ended".into());
        }
    }
    if let Decision::Freeze { members, .. } = d {
        let cur: BTreeSet<&String> = input.current.iter().flatten().collect();
        for m in members {
            if input.excluded.contains(m) && !cur.contains(m) {
                return Err(format!("admitted {m}, which was left out of a regroup"));
            }
        }
    }
    match d {
        Decision::Freeze { members, .. } => {
            let set: BTreeSet<&String> = members.iter().collect();
            if set.len() != members.len() {
                return Err("duplicate member".into());
            }
            if members.is_empty() || members.len() > cfg.max_nodes as usize {
                return Err(format!("{} members outside 1..=max", members.len()));
            }
            if (members.len() as u32) < cfg.min_nodes {
                return Err("froze below min".into());
            }
            for m in members {
                let ok = input
                    .members
                    .iter()
                    .any(|o| &o.node_id == m && o.state == MemberState::Alive);
                if !ok {
                    return Err(format!("{m} is not present and alive"));
                }
            }
            if let Some(cur) = &input.current {
                let kept: Vec<&String> = members.iter().filter(|m| cur.contains(m)).collect();
                let expect: Vec<&String> = cur.iter().filter(|m| members.contains(m)).collect();
                if kept != expect {
                    return Err("survivors changed their relative order".into());
                }
                if members[..kept.len()].iter().collect::<Vec<_>>() != kept {
                    return Err("a newcomer was ranked before a survivor".into());
                }
                let newcomers: Vec<_> = members[kept.len()..]
                    .iter()
                    .map(|m| {
                        let o = input.members.iter().find(|o| &o.node_id == m).unwrap();
                        (o.joined_at, o.node_id.clone())
                    })
                    .collect();
                if !newcomers.is_sorted() {
                    return Err("newcomers not in join order".into());
                }
                let stale = matches!(d.reason(), Reason::StaleResume { .. });
                if members == cur && !restart_current && !stale {
                    return Err("froze the same generation again".into());
                }
            }
        }
        Decision::Wait { until_ms, .. } => {
            if *until_ms <= input.now_ms {
                return Err("wait deadline not in the future".into());
            }
        }
        Decision::Fail { .. } => {
            let eligible = input
                .members
                .iter()
                .filter(|m| m.state == MemberState::Alive && !input.excluded.contains(&m.node_id))
                .count() as u32;
            if eligible >= cfg.min_nodes {
                return Err("failed with min eligible members present".into());
            }
        }
        Decision::Keep { .. } => {}
    }
    Ok(())
}

#[test]
fn random_inputs_keep_the_invariants() {
    let seed: u64 = std::env::var("ELASTIC_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut freezes = 0;
    for i in 0..CASES {
        let (cfg, input) = random_case(&mut rng);
        let d = decide(&cfg, &input);
        if let Err(why) = check(&cfg, &input, &d) {
            panic!(
                "seed {seed} (ELASTIC_SEED={seed} to replay), case {i}: {why}\nconfig {cfg:?}\ninput {input:?}\ndecision {d:?}"
            );
        }
        freezes += matches!(d, Decision::Freeze { .. }) as usize;
    }
    // The sweep must exercise the interesting branch, or it proves nothing.
    assert!(freezes > CASES / 20, "only {freezes} freezes (seed {seed})");
}
