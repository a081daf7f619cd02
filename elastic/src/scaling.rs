//! The scaling policy: learning rate, global batch and gradient accumulation for a world size.
//!
//! Pure and deterministic. With per-worker batch `b`, world size `W` (processes) and base world
//! size `W0`:
//! - `linear`: LR x W/W0; `sqrt`: LR x sqrt(W/W0); `none`: LR unchanged. The global batch is
//!   `b x W` and there is no accumulation.
//! - `fixed`: the global batch `B` stays constant, LR is untouched, and
//!   `b' x W x accum = B` where `b' <= b`. When no exact split exists, `Nearest` picks the
//!   configuration whose global batch is closest to `B` (ties: the larger per-worker batch, then
//!   fewer accumulation steps) and says so in `note`; `Refuse` returns [`Error::Indivisible`].
//! - Warm-up: when the LR differs from the previous generation's (or from the base LR for the
//!   first generation), `warmup_steps` ramps it in over the configured steps; otherwise 0.
//!
//! The per-worker batch and the base LR may be unknown (`None`: the user did not give them).
//! Then so are the decision's batches and LR, and [`ScalingDecision::env`] leaves their
//! variables out; `fixed` needs the batch ([`Error::FixedNeedsBatch`]).

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Per-worker batches above this are rejected: the `fixed` search is linear in `b`.
pub const PER_WORKER_BATCH_MAX: u64 = 1 << 20;

/// How the learning rate follows the world size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScalingMode {
    /// LR x W/W0.
    Linear,
    /// LR x sqrt(W/W0).
    Sqrt,
    /// LR untouched.
    None,
    /// Keep the global batch: grad accumulation changes, LR untouched.
    Fixed,
}

impl ScalingMode {
    /// Every mode, in the order help texts list them.
    pub const ALL: [ScalingMode; 4] = [Self::Linear, Self::Sqrt, Self::None, Self::Fixed];

    /// The name [`FromStr`](std::str::FromStr) reads and [`Display`](std::fmt::Display)
    /// writes (as in the records).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Linear => "linear",
            Self::Sqrt => "sqrt",
            Self::None => "none",
            Self::Fixed => "fixed",
        }
    }
}

impl std::fmt::Display for ScalingMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ScalingMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| Error::InvalidConfig {
                field: "lr_scaling",
                reason: format!("{s:?} is not one of linear, sqrt, none, fixed"),
            })
    }
}

/// What `fixed` does when the global batch cannot be split exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnIndivisible {
    /// Use the nearest valid configuration, and say so in the decision's `note`.
    Nearest,
    /// Refuse the world size ([`Error::Indivisible`]).
    Refuse,
}

impl OnIndivisible {
    /// Both choices, in the order help texts list them.
    pub const ALL: [OnIndivisible; 2] = [Self::Nearest, Self::Refuse];

    /// The name [`FromStr`](std::str::FromStr) reads and [`Display`](std::fmt::Display)
    /// writes.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Nearest => "nearest",
            Self::Refuse => "refuse",
        }
    }
}

impl std::fmt::Display for OnIndivisible {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for OnIndivisible {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| Error::InvalidConfig {
                field: "on_indivisible",
                reason: format!("{s:?} is not one of nearest, refuse"),
            })
    }
}

/// The job-wide scaling configuration (fixed for the job's life).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScalingConfig {
    pub mode: ScalingMode,
    /// Per-worker (per-process) batch `b`; `None` when unknown (the decision's batches are
    /// then unknown too; `fixed` refuses it).
    pub per_worker_batch: Option<u64>,
    /// Base world size `W0` (processes) at which `base_lr` was tuned.
    pub base_world_size: u64,
    /// `None` when unknown: the decision's `lr` is then unknown too.
    pub base_lr: Option<f64>,
    /// Global batch `B` for `fixed`; ignored otherwise.
    pub global_batch: Option<u64>,
    pub on_indivisible: OnIndivisible,
    /// Steps over which the LR ramps after it changes; `None` for no warm-up.
    pub warmup_steps: Option<u64>,
}

/// The scaling for one generation. Travels in the generation record (unknown values as
/// `null`); workers read it from the `ELASTIC_*` environment ([`ScalingDecision::env`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScalingDecision {
    pub lr_scale: f64,
    /// `base_lr x lr_scale`; `None` when the base LR is unknown.
    pub lr: Option<f64>,
    /// Per-worker batch x world x accumulation; `None` when the batch is unknown.
    pub global_batch: Option<u64>,
    pub grad_accum_steps: u64,
    /// Per-worker batch (lowered by `fixed` when that makes the split exact); `None` when
    /// unknown.
    pub per_worker_batch: Option<u64>,
    pub warmup_steps: u64,
    /// Human-readable account of any adjustment; empty when none.
    pub note: String,
}

impl ScalingDecision {
    /// No scaling: LR scale 1, no accumulation, no warm-up; batches and LR unknown.
    pub fn identity() -> Self {
        ScalingDecision {
            lr_scale: 1.0,
            lr: None,
            global_batch: None,
            grad_accum_steps: 1,
            per_worker_batch: None,
            warmup_steps: 0,
            note: String::new(),
        }
    }

    /// The `ELASTIC_*` scaling variables workers start with: the only place they are written.
    /// Unknown values are left out rather than set empty. Numbers use Rust's round-trip
    /// formatting (`0.1`, `2`).
    pub fn env(&self) -> Vec<(&'static str, String)> {
        let mut env = vec![("ELASTIC_LR_SCALE", self.lr_scale.to_string())];
        if let Some(lr) = self.lr {
            env.push(("ELASTIC_LR", lr.to_string()));
        }
        if let Some(g) = self.global_batch {
            env.push(("ELASTIC_GLOBAL_BATCH", g.to_string()));
        }
        // Workers divide by it: at least 1, whatever a record says.
        env.push((
            "ELASTIC_GRAD_ACCUM_STEPS",
            self.grad_accum_steps.max(1).to_string(),
        ));
        if let Some(b) = self.per_worker_batch {
            env.push(("ELASTIC_BATCH_SIZE", b.to_string()));
        }
        env.push(("ELASTIC_WARMUP_STEPS", self.warmup_steps.to_string()));
        env
    }
}

impl ScalingConfig {
    /// Checks the configuration alone (no world size).
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(Error::InvalidScaling { reason });
        if let Some(b) = self.per_worker_batch
            && (b == 0 || b > PER_WORKER_BATCH_MAX)
        {
            return bad(format!(
                "per-worker batch {b} outside 1..={PER_WORKER_BATCH_MAX}"
            ));
        }
        if self.base_world_size == 0 {
            return bad("base world size is 0".into());
        }
        if let Some(lr) = self.base_lr
            && !(lr.is_finite() && lr >= 0.0)
        {
            return bad(format!("base LR {lr} is not a finite non-negative number"));
        }
        if self.mode == ScalingMode::Fixed {
            if self.per_worker_batch.is_none() {
                return Err(Error::FixedNeedsBatch);
            }
            if !matches!(self.global_batch, Some(b) if b > 0) {
                return bad("fixed scaling needs a global batch above 0".into());
            }
        }
        Ok(())
    }

    /// The decision for `world_size` processes; `previous_world_size` is the last generation's
    /// (`None` for the first), used to decide whether the LR changed and a warm-up applies.
    pub fn decide(
        &self,
        world_size: u64,
        previous_world_size: Option<u64>,
    ) -> Result<ScalingDecision> {
        self.validate()?;
        if world_size == 0 {
            return Err(Error::InvalidScaling {
                reason: "world size is 0".into(),
            });
        }
        let lr_scale = self.lr_scale(world_size);
        let (per_worker_batch, grad_accum_steps, global_batch, note) = match self.mode {
            ScalingMode::Fixed => {
                let b = self.per_worker_batch.ok_or(Error::FixedNeedsBatch)?;
                let target = self.global_batch.unwrap_or(0);
                let (bp, accum, global, note) = self.fixed_split(b, target, world_size)?;
                (Some(bp), accum, Some(global), note)
            }
            _ => (
                self.per_worker_batch,
                1,
                self.per_worker_batch.map(|b| b.saturating_mul(world_size)),
                String::new(),
            ),
        };
        let previous_scale = previous_world_size
            .filter(|w| *w > 0)
            .map(|w| self.lr_scale(w))
            .unwrap_or(1.0);
        let warmup_steps = match self.warmup_steps {
            Some(n) if (lr_scale - previous_scale).abs() > 1e-12 => n,
            _ => 0,
        };
        Ok(ScalingDecision {
            lr_scale,
            lr: self.base_lr.map(|lr| lr * lr_scale),
            global_batch,
            grad_accum_steps,
            per_worker_batch,
            warmup_steps,
            note,
        })
    }

    fn lr_scale(&self, world_size: u64) -> f64 {
        let ratio = world_size as f64 / self.base_world_size as f64;
        match self.mode {
            ScalingMode::Linear => ratio,
            ScalingMode::Sqrt => ratio.sqrt(),
            ScalingMode::None | ScalingMode::Fixed => 1.0,
        }
    }

    /// `(per_worker_batch, accum, global_batch, note)` for `fixed` with per-worker batch `b`.
    fn fixed_split(&self, b: u64, target: u64, world: u64) -> Result<(u64, u64, u64, String)> {
        // Exact split with the configured per-worker batch: the common case.
        let full = b.saturating_mul(world);
        if target.is_multiple_of(full) {
            return Ok((b, target / full, target, String::new()));
        }
        // Search every per-worker batch b' <= b for the closest global batch.
        let mut best: Option<(u64, u64, u64, u64)> = None; // (distance, b', accum, global)
        for bp in (1..=b).rev() {
            let step = bp.saturating_mul(world);
            let accum = ((target + step / 2) / step).max(1);
            let global = step.saturating_mul(accum);
            let distance = global.abs_diff(target);
            let better = match best {
                None => true,
                Some((d, _, a, _)) => distance < d || (distance == d && accum < a),
            };
            if better {
                best = Some((distance, bp, accum, global));
            }
            if distance == 0 {
                break;
            }
        }
        let (distance, bp, accum, global) = best.expect("b >= 1 gives one candidate");
        if distance == 0 {
            let note = format!(
                "per-worker batch lowered from {b} to {bp} so that {bp} x {world} x {accum} = {target}"
            );
            return Ok((bp, accum, global, note));
        }
        match self.on_indivisible {
            OnIndivisible::Refuse => Err(Error::Indivisible {
                global_batch: target,
                per_worker_batch: b,
                world_size: world,
            }),
            OnIndivisible::Nearest => Ok((
                bp,
                accum,
                global,
                format!(
                    "global batch {target} cannot be split over {world} workers with per-worker batch <= {b}; using nearest {global} = {bp} x {world} x {accum}"
                ),
            )),
        }
    }
}

/// A decision for unit tests that need a well-formed [`Generation`](crate::record::Generation):
/// no scaling, one process.
#[cfg(test)]
pub(crate) fn decision_for_tests() -> ScalingDecision {
    ScalingConfig {
        mode: ScalingMode::None,
        per_worker_batch: Some(1),
        base_world_size: 1,
        base_lr: Some(1.0),
        global_batch: None,
        on_indivisible: OnIndivisible::Nearest,
        warmup_steps: None,
    }
    .decide(1, None)
    .expect("a valid config")
}
