//! The scaling decision for one world size, as workers see it: LR scale, per-worker batch,
//! gradient accumulation and global batch.
//!
//! The policy itself lives in the `elastic` crate ([`elastic::scaling`]), so standalone,
//! static and etcd runs decide identically: in etcd runs the leader decides and the generation
//! record carries the [`elastic::ScalingDecision`]; standalone and static runs call
//! [`decide`] here. [`Scaling`] is that decision with what the user did not configure left
//! unknown (no `--batch-size`: no `ELASTIC_BATCH_SIZE`; no `--base-lr`: no `ELASTIC_LR`).

use elastic::ScalingDecision;
use elastic::scaling::{OnIndivisible, ScalingConfig as PolicyConfig, ScalingMode};

use crate::cli::LrScaling;

/// What the user configured; every value is per job, not per world size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScalingConfig {
    pub policy: LrScaling,
    /// World size the base LR and batch were tuned for.
    pub base_world_size: u32,
    /// Per-worker batch.
    pub batch_size: Option<u64>,
    /// Global batch kept constant under `fixed` (default: batch x base world size).
    pub global_batch: Option<u64>,
    pub base_lr: Option<f64>,
    /// Steps over which the LR ramps after it changes; 0 for none.
    pub warmup_steps: u64,
    /// What `fixed` does when the global batch cannot be split exactly.
    pub on_indivisible: OnIndivisible,
}

/// The decision for one world size, as the workers see it through `ELASTIC_*`.
#[derive(Debug, Clone, PartialEq)]
pub struct Scaling {
    pub lr_scale: f64,
    /// `base_lr x lr_scale`, when a base LR was given.
    pub lr: Option<f64>,
    /// Per-worker batch (lowered by `fixed` when that makes the split exact).
    pub batch_size: Option<u64>,
    /// Effective global batch: batch x world x accumulation, when the batch is known.
    pub global_batch: Option<u64>,
    pub grad_accum_steps: u64,
    pub warmup_steps: u64,
    /// How the policy adjusted the configuration, if it did.
    pub note: String,
}

impl Scaling {
    /// No scaling at all: what a worker sees when nothing was configured.
    pub fn identity() -> Self {
        Scaling {
            lr_scale: 1.0,
            lr: None,
            batch_size: None,
            global_batch: None,
            grad_accum_steps: 1,
            warmup_steps: 0,
            note: String::new(),
        }
    }
}

/// Why a configuration cannot be scaled to a world size.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScalingError {
    #[error("world size must be at least 1")]
    EmptyWorld,
    #[error("--lr-scaling fixed needs --batch-size (and optionally --global-batch)")]
    FixedNeedsBatch,
    #[error("{0}")]
    Policy(String),
}

impl ScalingConfig {
    /// The `elastic` policy configuration. Unknown batch and LR become 1 and 0: they only
    /// feed values that [`from_decision`] drops again.
    pub fn to_policy(&self) -> Result<PolicyConfig, ScalingError> {
        let mode = match self.policy {
            LrScaling::Linear => ScalingMode::Linear,
            LrScaling::Sqrt => ScalingMode::Sqrt,
            LrScaling::None => ScalingMode::None,
            LrScaling::Fixed => ScalingMode::Fixed,
        };
        if self.base_world_size == 0 {
            return Err(ScalingError::EmptyWorld);
        }
        let global_batch = match mode {
            ScalingMode::Fixed => {
                let b = self.batch_size.ok_or(ScalingError::FixedNeedsBatch)?;
                Some(
                    self.global_batch
                        .unwrap_or(b.saturating_mul(u64::from(self.base_world_size))),
                )
            }
            _ => self.global_batch,
        };
        let cfg = PolicyConfig {
            mode,
            per_worker_batch: self.batch_size.unwrap_or(1),
            base_world_size: u64::from(self.base_world_size),
            base_lr: self.base_lr.unwrap_or(0.0),
            global_batch,
            on_indivisible: self.on_indivisible,
            warmup_steps: (self.warmup_steps > 0).then_some(self.warmup_steps),
        };
        cfg.validate()
            .map_err(|e| ScalingError::Policy(e.to_string()))?;
        Ok(cfg)
    }
}

/// Decides the scaling for `world_size` workers; `previous_world_size` is the world the job
/// ran at before (for the warm-up rule), `None` at the start.
pub fn decide(
    cfg: &ScalingConfig,
    world_size: u32,
    previous_world_size: Option<u32>,
) -> Result<Scaling, ScalingError> {
    if world_size == 0 {
        return Err(ScalingError::EmptyWorld);
    }
    let policy = cfg.to_policy()?;
    let d = policy
        .decide(u64::from(world_size), previous_world_size.map(u64::from))
        .map_err(|e| ScalingError::Policy(e.to_string()))?;
    Ok(from_decision(&d, cfg))
}

/// What workers see of a decision (made here or by the etcd leader).
pub fn from_decision(d: &ScalingDecision, cfg: &ScalingConfig) -> Scaling {
    let batch_known = cfg.batch_size.is_some();
    Scaling {
        lr_scale: d.lr_scale,
        lr: cfg.base_lr.map(|_| d.lr),
        batch_size: batch_known.then_some(d.per_worker_batch),
        global_batch: batch_known.then_some(d.global_batch),
        grad_accum_steps: d.grad_accum_steps.max(1),
        warmup_steps: d.warmup_steps,
        note: d.note.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(policy: LrScaling) -> ScalingConfig {
        ScalingConfig {
            policy,
            base_world_size: 4,
            batch_size: Some(32),
            global_batch: None,
            base_lr: Some(0.1),
            warmup_steps: 10,
            on_indivisible: OnIndivisible::Nearest,
        }
    }

    #[test]
    fn policies_scale_lr_and_accumulation_as_documented() {
        // (policy, world, lr_scale, per-worker batch, accum, global)
        let table = [
            (LrScaling::Linear, 8, 2.0, 32, 1, 256),
            (LrScaling::Linear, 2, 0.5, 32, 1, 64),
            (LrScaling::Sqrt, 16, 2.0, 32, 1, 512),
            (LrScaling::Sqrt, 1, 0.5, 32, 1, 32),
            (LrScaling::None, 8, 1.0, 32, 1, 256),
            (LrScaling::Fixed, 2, 1.0, 32, 2, 128),
            (LrScaling::Fixed, 4, 1.0, 32, 1, 128),
            (LrScaling::Fixed, 1, 1.0, 32, 4, 128),
            // 128 over 3 workers has no exact split; the nearest global batch is 1 x 3 x 43 = 129.
            (LrScaling::Fixed, 3, 1.0, 1, 43, 129),
        ];
        for (policy, world, scale, batch, accum, global) in table {
            let s = decide(&cfg(policy), world, Some(4)).unwrap();
            assert!(
                (s.lr_scale - scale).abs() < 1e-12,
                "{policy:?} {world}: {s:?}"
            );
            assert!((s.lr.unwrap() - 0.1 * scale).abs() < 1e-12);
            assert_eq!(s.batch_size, Some(batch), "{policy:?} {world}");
            assert_eq!(s.grad_accum_steps, accum, "{policy:?} {world}");
            assert_eq!(s.global_batch, Some(global), "{policy:?} {world}");
        }
    }

    #[test]
    fn warmup_applies_only_when_the_lr_changes() {
        let c = cfg(LrScaling::Linear);
        assert_eq!(decide(&c, 8, Some(4)).unwrap().warmup_steps, 10);
        assert_eq!(decide(&c, 8, Some(8)).unwrap().warmup_steps, 0);
    }

    #[test]
    fn fixed_refuses_an_indivisible_batch_when_asked_to() {
        let mut c = cfg(LrScaling::Fixed);
        c.on_indivisible = OnIndivisible::Refuse;
        c.batch_size = Some(1);
        c.global_batch = Some(7);
        let e = decide(&c, 2, None).unwrap_err();
        assert!(e.to_string().contains('7'), "{e}");
    }

    #[test]
    fn fixed_without_batch_is_an_error() {
        let mut c = cfg(LrScaling::Fixed);
        c.batch_size = None;
        assert_eq!(decide(&c, 2, None), Err(ScalingError::FixedNeedsBatch));
        assert_eq!(
            decide(&cfg(LrScaling::None), 0, None),
            Err(ScalingError::EmptyWorld)
        );
    }

    #[test]
    fn unknown_batch_and_lr_stay_unknown() {
        let mut c = cfg(LrScaling::Linear);
        c.batch_size = None;
        c.base_lr = None;
        let s = decide(&c, 8, None).unwrap();
        assert_eq!(s.global_batch, None);
        assert_eq!(s.batch_size, None);
        assert_eq!(s.lr, None);
        assert_eq!(s.lr_scale, 2.0);
    }
}
