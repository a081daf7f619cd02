//! The scaling decision for one world size: LR scale, grad accumulation and global batch.
//!
//! Pure arithmetic, no I/O. Standalone and static runs compute it here; in elastic runs the
//! generation record carries the decision made by the `elastic` crate's policy and the agent
//! copies it into [`crate::worker_env::GenerationView::scaling`] unchanged.

use crate::cli::LrScaling;

/// Largest grad-accumulation factor accepted: past this, the configuration is a mistake
/// (a global batch far larger than the world can hold), not a schedule.
pub const GRAD_ACCUM_STEPS_MAX: u64 = 65_536;

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
    pub warmup_steps: u64,
}

/// The decision for one world size, as the workers see it through `ELASTIC_*`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scaling {
    pub lr_scale: f64,
    /// `base_lr x lr_scale`, when a base LR was given.
    pub lr: Option<f64>,
    pub batch_size: Option<u64>,
    /// Effective global batch: batch x world x accumulation, when the batch is known.
    pub global_batch: Option<u64>,
    pub grad_accum_steps: u64,
    pub warmup_steps: u64,
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
        }
    }
}

/// Why a configuration cannot be scaled to a world size.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScalingError {
    #[error("world size must be at least 1")]
    EmptyWorld,
    #[error("--lr-scaling fixed needs --batch-size (and optionally --global-batch)")]
    FixedNeedsBatch,
    #[error(
        "global batch {global_batch} needs {accum} accumulation steps at world size {world_size} \
         and batch {batch_size}; more than {GRAD_ACCUM_STEPS_MAX}"
    )]
    AccumulationTooLarge {
        global_batch: u64,
        world_size: u32,
        batch_size: u64,
        accum: u64,
    },
}

/// Decides the scaling for `world_size` workers.
pub fn decide(cfg: &ScalingConfig, world_size: u32) -> Result<Scaling, ScalingError> {
    if world_size == 0 || cfg.base_world_size == 0 {
        return Err(ScalingError::EmptyWorld);
    }
    let ratio = f64::from(world_size) / f64::from(cfg.base_world_size);
    let (lr_scale, grad_accum_steps) = match cfg.policy {
        LrScaling::Linear => (ratio, 1),
        LrScaling::Sqrt => (ratio.sqrt(), 1),
        LrScaling::None => (1.0, 1),
        LrScaling::Fixed => {
            let batch = cfg.batch_size.ok_or(ScalingError::FixedNeedsBatch)?;
            let target = cfg
                .global_batch
                .unwrap_or(batch.saturating_mul(u64::from(cfg.base_world_size)));
            let per_step = batch.saturating_mul(u64::from(world_size));
            // Round up: never train with a smaller global batch than asked for.
            let accum = target.div_ceil(per_step).max(1);
            if accum > GRAD_ACCUM_STEPS_MAX {
                return Err(ScalingError::AccumulationTooLarge {
                    global_batch: target,
                    world_size,
                    batch_size: batch,
                    accum,
                });
            }
            (1.0, accum)
        }
    };
    let global_batch = cfg.batch_size.map(|b| {
        b.saturating_mul(u64::from(world_size))
            .saturating_mul(grad_accum_steps)
    });
    Ok(Scaling {
        lr_scale,
        lr: cfg.base_lr.map(|lr| lr * lr_scale),
        batch_size: cfg.batch_size,
        global_batch,
        grad_accum_steps,
        warmup_steps: cfg.warmup_steps,
    })
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
        }
    }

    #[test]
    fn policies_scale_lr_and_accumulation_as_documented() {
        // (policy, world, lr_scale, accum, global)
        let table = [
            (LrScaling::Linear, 8, 2.0, 1, 256),
            (LrScaling::Linear, 2, 0.5, 1, 64),
            (LrScaling::Sqrt, 16, 2.0, 1, 512),
            (LrScaling::Sqrt, 1, 0.5, 1, 32),
            (LrScaling::None, 8, 1.0, 1, 256),
            (LrScaling::Fixed, 2, 1.0, 2, 128),
            (LrScaling::Fixed, 4, 1.0, 1, 128),
            (LrScaling::Fixed, 1, 1.0, 4, 128),
            // 128 / (32 x 3) = 1.33: rounded up so the global batch never shrinks.
            (LrScaling::Fixed, 3, 1.0, 2, 192),
        ];
        for (policy, world, scale, accum, global) in table {
            let s = decide(&cfg(policy), world).unwrap();
            assert!(
                (s.lr_scale - scale).abs() < 1e-12,
                "{policy:?} {world}: {s:?}"
            );
            assert!((s.lr.unwrap() - 0.1 * scale).abs() < 1e-12);
            assert_eq!(s.grad_accum_steps, accum, "{policy:?} {world}");
            assert_eq!(s.global_batch, Some(global), "{policy:?} {world}");
            assert_eq!(s.warmup_steps, 10);
        }
    }

    #[test]
    fn fixed_keeps_an_explicit_global_batch() {
        let mut c = cfg(LrScaling::Fixed);
        c.global_batch = Some(1024);
        let s = decide(&c, 8).unwrap();
        assert_eq!(s.grad_accum_steps, 4);
        assert_eq!(s.global_batch, Some(1024));
    }

    #[test]
    fn fixed_without_batch_and_absurd_accumulation_are_errors() {
        let mut c = cfg(LrScaling::Fixed);
        c.batch_size = None;
        assert_eq!(decide(&c, 2), Err(ScalingError::FixedNeedsBatch));
        let mut c = cfg(LrScaling::Fixed);
        c.global_batch = Some(u64::MAX);
        assert!(matches!(
            decide(&c, 1),
            Err(ScalingError::AccumulationTooLarge { .. })
        ));
        assert_eq!(
            decide(&cfg(LrScaling::None), 0),
            Err(ScalingError::EmptyWorld)
        );
    }

    #[test]
    fn unknown_batch_leaves_global_batch_unknown() {
        let mut c = cfg(LrScaling::Linear);
        c.batch_size = None;
        c.base_lr = None;
        let s = decide(&c, 8).unwrap();
        assert_eq!(s.global_batch, None);
        assert_eq!(s.lr, None);
        assert_eq!(s.lr_scale, 2.0);
    }
}
