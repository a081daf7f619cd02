//! Training itself: every generation follows the scenario's scaling policy, and the final
//! weights match a fault-free reference run.

use super::{Check, Outcome};
use crate::events::{Record, generations};
use crate::scenario::Scenario;

/// The expected scaling of a world size under the scenario's policy.
fn expected_scaling(s: &Scenario, world: u64) -> Option<elastic::ScalingDecision> {
    let mode = s.lr_scaling.parse().ok()?;
    let cfg = elastic::ScalingConfig {
        mode,
        per_worker_batch: Some(s.batch_size),
        base_world_size: u64::from(s.base_world()),
        base_lr: Some(0.05),
        global_batch: s.global_batch,
        on_indivisible: elastic::OnIndivisible::Nearest,
        warmup_steps: None,
    };
    cfg.decide(world, None).ok()
}

/// 5. Every generation follows the scaling policy.
pub(super) fn scaling_policy(s: &Scenario, events: &[Record]) -> Check {
    let mut bad = Vec::new();
    for g in generations(events) {
        let world = u64::from(g.world_size);
        let Some(want) = expected_scaling(s, world) else {
            bad.push(format!("no decision for world {world}"));
            continue;
        };
        let (scale, accum, global) = (g.lr_scale, g.grad_accum_steps, g.global_batch);
        if (scale - want.lr_scale).abs() > 1e-9
            || accum != want.grad_accum_steps
            || global != want.global_batch
        {
            bad.push(format!(
                "generation {} world {world}: lr x{scale} accum {accum} global {global:?}, expected lr x{} accum {} global {:?}",
                g.generation, want.lr_scale, want.grad_accum_steps, want.global_batch
            ));
        }
    }
    Check::new(
        "scaling_policy",
        bad.is_empty(),
        if bad.is_empty() {
            format!(
                "{} generation records follow `{}`",
                generations(events).count(),
                s.lr_scaling
            )
        } else {
            bad.join("; ")
        },
    )
}

/// 6. Against a fault-free reference: bitwise equal weights while the world size stayed
///    the base one; within `weights_rtol` once it changed (gradients summed in another
///    order). Only for scenarios that compare.
pub(super) fn matches_reference(s: &Scenario, events: &[Record], o: &Outcome) -> Option<Check> {
    if !s.compare_reference {
        return None;
    }
    let base = u64::from(s.base_world());
    let mut worlds: Vec<u64> = generations(events)
        .map(|g| u64::from(g.world_size))
        .collect();
    worlds.sort_unstable();
    worlds.dedup();
    if worlds.iter().all(|w| *w == base) {
        return Some(Check::new(
            "matches_reference",
            o.digest.is_some() && o.digest == o.reference_digest,
            format!(
                "world {base} throughout: digest {:?}, reference {:?}",
                o.digest, o.reference_digest
            ),
        ));
    }
    let (ok, detail) = match &o.weights {
        Some(Ok(d)) => (
            d.max_rel_diff <= s.weights_rtol,
            format!(
                "worlds {worlds:?}: largest relative difference {:.3e} (in {}) over {} model tensors, tolerance {:.1e}",
                d.max_rel_diff, d.worst, d.tensors, s.weights_rtol
            ),
        ),
        Some(Err(e)) => (false, format!("weights not compared: {e}")),
        None => (false, "no reference weights".into()),
    };
    Some(Check::new("matches_reference_within_tolerance", ok, detail))
}

#[cfg(test)]
mod tests {
    use super::super::check;
    use super::super::tests::{events, outcome, scenario};
    use super::*;

    #[test]
    fn weights_match_bitwise_at_the_base_world_and_within_tolerance_after_a_change() {
        let mut s = scenario();
        s.compare_reference = true;
        let verdict = |evs: &[Record], o: &Outcome| {
            check(&s, evs, &[], o)
                .into_iter()
                .find(|c| c.name.starts_with("matches_reference"))
                .map(|c| (c.name, c.ok))
                .unwrap()
        };
        let diff = |d: f64| {
            Some(Ok(crate::weights::WeightsDiff {
                tensors: 6,
                max_rel_diff: d,
                worst: "model/0.weight".into(),
            }))
        };
        // World 3 throughout: digests decide.
        let same: Vec<Record> = events().into_iter().take(4).collect();
        let mut o = outcome();
        o.digest = Some("ab".into());
        o.reference_digest = Some("ab".into());
        assert_eq!(verdict(&same, &o), ("matches_reference", true));
        o.reference_digest = Some("cd".into());
        o.weights = diff(0.0);
        assert_eq!(verdict(&same, &o), ("matches_reference", false));
        // 3 -> 2: the tolerance decides, and a missing comparison fails.
        o.weights = diff(1e-6);
        assert_eq!(
            verdict(&events(), &o),
            ("matches_reference_within_tolerance", true)
        );
        o.weights = diff(1e-3);
        assert_eq!(
            verdict(&events(), &o),
            ("matches_reference_within_tolerance", false)
        );
        o.weights = Some(Err("no state".into()));
        assert!(!verdict(&events(), &o).1);
        o.weights = None;
        assert!(!verdict(&events(), &o).1);
    }
}
