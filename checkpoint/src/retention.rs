//! Retention and garbage collection.
//!
//! [`plan_gc`] is a pure function of the step states, the policy and the clock, so the rules
//! are tested with tables; [`Store::gc`] lists, plans and deletes.
//!
//! Rules:
//! - keep the newest `keep_last` committed steps (at least one: the newest committed step is
//!   never deleted, so no step is deleted before a newer one is committed);
//! - keep every committed step divisible by `keep_every`;
//! - delete other committed steps, manifest first, so a half-deleted step is uncommitted;
//! - delete uncommitted steps whose newest object is older than `leftover_age_ms_min` (a
//!   younger one may be a save in progress);
//! - inside kept steps, delete objects no manifest references (dead attempts) once they are
//!   older than the same bound.

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::error::Result;
use crate::format;
use crate::store::Store;

#[derive(Debug, Clone)]
pub struct RetentionPolicy {
    pub keep_last: usize,
    pub keep_every: Option<u64>,
    pub leftover_age_ms_min: u64,
}

/// One step as the planner sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepState {
    pub step: u64,
    pub committed: bool,
    /// Last-modified time of the step's newest object.
    pub newest_modified_ms: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GcDecision {
    Keep,
    DeleteCommitted,
    DeleteLeftover,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GcItem {
    pub step: u64,
    pub decision: GcDecision,
    pub reason: &'static str,
}

/// Decides, for every step, whether it stays. Pure.
pub fn plan_gc(states: &[StepState], policy: &RetentionPolicy, now_ms: i64) -> Vec<GcItem> {
    let mut committed: Vec<u64> = states
        .iter()
        .filter(|s| s.committed)
        .map(|s| s.step)
        .collect();
    committed.sort_unstable_by(|a, b| b.cmp(a));
    let keep_last = policy.keep_last.max(1);
    let mut out: Vec<GcItem> = states
        .iter()
        .map(|s| {
            let (decision, reason) = if s.committed {
                let pos = committed.iter().position(|c| *c == s.step).unwrap_or(0);
                if pos == 0 {
                    (GcDecision::Keep, "newest committed")
                } else if pos < keep_last {
                    (GcDecision::Keep, "within keep-last")
                } else if policy
                    .keep_every
                    .is_some_and(|n| n > 0 && s.step.is_multiple_of(n))
                {
                    (GcDecision::Keep, "multiple of keep-every")
                } else {
                    (GcDecision::DeleteCommitted, "outside retention")
                }
            } else if now_ms.saturating_sub(s.newest_modified_ms)
                >= policy.leftover_age_ms_min as i64
            {
                (GcDecision::DeleteLeftover, "uncommitted and old")
            } else {
                (
                    GcDecision::Keep,
                    "uncommitted but recent (may be in progress)",
                )
            };
            GcItem {
                step: s.step,
                decision,
                reason,
            }
        })
        .collect();
    out.sort_by_key(|i| i.step);
    out
}

#[derive(Debug, Clone, Serialize)]
pub struct GcReport {
    pub items: Vec<GcItem>,
    pub objects_deleted: usize,
    pub bytes_deleted: u64,
}

impl Store {
    /// Applies the retention policy. With `dry_run`, only plans.
    pub async fn gc(
        &self,
        policy: &RetentionPolicy,
        dry_run: bool,
        cancel: &CancellationToken,
    ) -> Result<GcReport> {
        let now_ms = crate::save::now_unix_ms() as i64;
        let committed: std::collections::BTreeSet<u64> =
            self.committed_steps(cancel).await?.into_iter().collect();
        let mut states = Vec::new();
        let mut listings = std::collections::BTreeMap::new();
        for step in self.steps(cancel).await? {
            let objs = self.list(&format::step_dir(step), cancel).await?;
            let newest = objs.iter().map(|o| o.2).max().unwrap_or(0);
            states.push(StepState {
                step,
                committed: committed.contains(&step),
                newest_modified_ms: newest,
            });
            listings.insert(step, objs);
        }
        let items = plan_gc(&states, policy, now_ms);
        let mut objects_deleted = 0;
        let mut bytes_deleted = 0;
        for item in &items {
            let objs = &listings[&item.step];
            // A kept step's manifest, read once for both its dead objects and its dead directories.
            let mut kept_manifest = None;
            let doomed: Vec<&(String, u64, i64)> = match item.decision {
                GcDecision::DeleteCommitted | GcDecision::DeleteLeftover => objs.iter().collect(),
                GcDecision::Keep if committed.contains(&item.step) => {
                    // Dead attempts inside a kept step.
                    let m = match self.read_manifest(item.step, cancel).await {
                        Ok(m) => m,
                        Err(e) => {
                            tracing::warn!(step = item.step, error = %e, "not cleaning a step whose manifest does not read");
                            continue;
                        }
                    };
                    let live_dirs: Vec<String> = m
                        .parts
                        .iter()
                        .flat_map(|p| {
                            [
                                format!("{}/", format::data_dir(item.step, &p.writer, &p.attempt)),
                                format::part_key(item.step, &p.writer, &p.attempt),
                            ]
                        })
                        .collect();
                    let manifest_key = format::manifest_key(item.step);
                    let doomed = objs
                        .iter()
                        .filter(|o| {
                            o.0 != manifest_key
                                && !live_dirs.iter().any(|d| o.0.starts_with(d.as_str()))
                                && now_ms.saturating_sub(o.2) >= policy.leftover_age_ms_min as i64
                        })
                        .collect();
                    kept_manifest = Some(m);
                    doomed
                }
                GcDecision::Keep => continue,
            };
            if !doomed.is_empty() || item.decision != GcDecision::Keep {
                tracing::info!(
                    step = item.step,
                    objects = doomed.len(),
                    reason = item.reason,
                    dry_run,
                    "gc"
                );
            }
            if dry_run {
                continue;
            }
            if item.decision == GcDecision::DeleteCommitted {
                // Uncommit first: from here on the step does not exist for any reader.
                self.delete(&format::manifest_key(item.step), cancel)
                    .await?;
            }
            for (key, size, _) in doomed {
                self.delete(key, cancel).await?;
                objects_deleted += 1;
                bytes_deleted += size;
            }
            if item.decision != GcDecision::Keep {
                self.remove_local_dir(&format::step_dir(item.step)).await?;
            } else if self.has_local_root() {
                // Dead attempt directories of a kept step: on file:// they may hold staged
                // uploads of a killed writer that no listing shows (even when nothing listed
                // was doomed: a writer killed in its first put leaves only those).
                let step_data = format!("{}/data", format::step_dir(item.step));
                let Some(m) = &kept_manifest else {
                    continue;
                };
                for dir in self.list_dirs(&step_data, cancel).await? {
                    let live = m
                        .parts
                        .iter()
                        .any(|p| format!("{}-{}", p.writer, p.attempt) == dir);
                    let prefix = format!("{step_data}/{dir}/");
                    let young = objs.iter().any(|o| {
                        o.0.starts_with(&prefix)
                            && now_ms.saturating_sub(o.2) < policy.leftover_age_ms_min as i64
                    });
                    if !live && !young {
                        self.remove_local_dir(&format!("{step_data}/{dir}")).await?;
                    }
                }
            }
        }
        Ok(GcReport {
            items,
            objects_deleted,
            bytes_deleted,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(step: u64, committed: bool, t: i64) -> StepState {
        StepState {
            step,
            committed,
            newest_modified_ms: t,
        }
    }

    #[test]
    fn retention_table() {
        let policy = RetentionPolicy {
            keep_last: 2,
            keep_every: Some(100),
            leftover_age_ms_min: 1000,
        };
        let now = 10_000;
        let states = [
            st(100, true, 0),
            st(150, true, 0),
            st(200, true, 0),
            st(250, true, 0),
            st(300, true, 0),
            st(310, false, 9_500),
            st(120, false, 0),
        ];
        let plan = plan_gc(&states, &policy, now);
        let d = |s: u64| plan.iter().find(|i| i.step == s).unwrap().decision;
        assert_eq!(d(300), GcDecision::Keep);
        assert_eq!(d(250), GcDecision::Keep);
        assert_eq!(d(200), GcDecision::Keep);
        assert_eq!(d(100), GcDecision::Keep);
        assert_eq!(d(150), GcDecision::DeleteCommitted);
        assert_eq!(
            d(310),
            GcDecision::Keep,
            "recent leftover may be in progress"
        );
        assert_eq!(d(120), GcDecision::DeleteLeftover);
    }

    #[test]
    fn newest_committed_step_survives_keep_last_zero() {
        let policy = RetentionPolicy {
            keep_last: 0,
            keep_every: None,
            leftover_age_ms_min: 0,
        };
        let plan = plan_gc(
            &[st(1, true, 0), st(2, true, 0), st(3, false, 0)],
            &policy,
            5,
        );
        assert_eq!(plan[1].decision, GcDecision::Keep);
        assert_eq!(plan[0].decision, GcDecision::DeleteCommitted);
        assert_eq!(plan[2].decision, GcDecision::DeleteLeftover);
    }
}
