//! Retention and garbage collection.
//!
//! [`plan_gc`] is a pure function of the step states, the policy and the clock, so the rules
//! are tested with tables (`testdata/gc.json`) and a seeded random sweep; [`Store::gc`] lists,
//! checks, plans and deletes.
//!
//! Rules, for committed steps (those with a manifest):
//! - the newest step that verifies is never deleted, whatever the policy;
//! - keep the newest `keep_last` steps that verify (at least 1: a policy with `keep_last` 0 is
//!   refused by [`Store::gc`]); a step that does not verify, or was not checked, never counts
//!   toward `keep_last`;
//! - a step that does not verify and is newer than every step that does is kept, for
//!   inspection (if no step verifies, no committed step is deleted); one older than the newest
//!   step that verifies is deleted like any step outside retention;
//! - keep every step divisible by `keep_every` (verified or not: a milestone asked for by name);
//! - keep the step [`RetentionPolicy::pinned`] names (the agent's step just committed): it
//!   counts as verifying, unchecked, and is kept even when newer ones fill `keep_last`;
//! - delete other committed steps, manifest first, so a half-deleted step is uncommitted;
//! - delete uncommitted steps whose newest object is older than `leftover_age_ms_min` (a
//!   younger one may be a save in progress);
//! - inside kept steps, delete objects no manifest references (dead attempts) once they are
//!   older than the same bound.
//!
//! What "verifies" means ([`GcCheck`]): [`Store::gc`] checks committed steps newest first and
//! stops once `keep_last` of them pass, so it reads only the steps it keeps (and newer ones that
//! fail), never the ones it deletes; older unchecked steps go by the other rules.
//! [`GcCheck::Full`], the default of `elastic-ckpt gc`, reads every object of those steps and
//! checks its checksums: only that sees a flipped bit, and a gc that keeps a step it never read
//! can delete the last good one. [`GcCheck::Present`] (`elastic-ckpt gc --fast`, and the agent's
//! retention after each commit) only reads manifests and checks that their objects exist with
//! their recorded sizes: it catches a garbled manifest or a missing or truncated object, not a
//! flipped bit, so it is safe only where the newest step is known good, as in the agent, whose
//! newest step it has just uploaded with checksums and committed.
//!
//! Only integrity errors ([`Error::is_integrity`]) make a step "not verify". Any other error
//! while checking (the store unreachable, access denied, a manifest gone between the listing and
//! the read) aborts gc before it deletes anything.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::format::{self, Manifest};
use crate::restore::ReadOptions;
use crate::store::Store;

/// What gc keeps. [`Store::gc`] refuses a policy that [`RetentionPolicy::validate`] rejects.
#[derive(Debug, Clone)]
pub struct RetentionPolicy {
    /// Steps that verify to keep, newest first (at least 1).
    pub keep_last: usize,
    /// Also keep every committed step divisible by this (at least 1).
    pub keep_every: Option<u64>,
    pub leftover_age_ms_min: u64,
    /// How the steps counted toward `keep_last` are checked.
    pub check: GcCheck,
    /// A committed step the caller knows to be good (the agent's step just committed, whose
    /// chunks it checksummed as it uploaded them): counted as verifying without a check, and
    /// never deleted, even when newer steps that pass fill `keep_last`.
    pub pinned: Option<u64>,
}

impl RetentionPolicy {
    /// `keep_last` 0 would ask gc to delete the newest step that verifies; `keep_every` 0
    /// means nothing.
    pub fn validate(&self) -> Result<()> {
        if self.keep_last == 0 {
            return Err(Error::InvalidInput(
                "retention keep_last must be at least 1: gc never deletes the newest step that verifies"
                    .into(),
            ));
        }
        if self.keep_every == Some(0) {
            return Err(Error::InvalidInput(
                "retention keep_every must be at least 1".into(),
            ));
        }
        Ok(())
    }
}

/// How [`Store::gc`] checks that a committed step verifies (see the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GcCheck {
    /// The manifest reads and validates, and every object it lists exists with its recorded
    /// size. No data is read, so a flipped bit goes unseen.
    Present,
    /// Every object is read and its length and checksums checked ([`Store::verify`]).
    #[default]
    Full,
}

/// What gc found when it checked a committed step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepCheck {
    Verified,
    /// An integrity error: the step cannot be restored as it is.
    Failed,
    /// Not checked (`keep_last` steps that verify were already found among newer ones), or
    /// not committed.
    Unchecked,
}

/// One step as the planner sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepState {
    pub step: u64,
    pub committed: bool,
    /// For committed steps; ignored for uncommitted ones.
    pub check: StepCheck,
    /// Last-modified time of the step's newest object.
    pub newest_modified_ms: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GcDecision {
    Keep,
    DeleteCommitted,
    DeleteLeftover,
}

/// Why a step is kept or deleted; [`std::fmt::Display`] gives the sentence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GcReason {
    /// Kept: the newest step that verifies.
    NewestVerified,
    /// Kept: among the newest `keep_last` steps that verify.
    WithinKeepLast,
    /// Kept: divisible by `keep_every`.
    KeepEvery,
    /// Kept: [`RetentionPolicy::pinned`], older than the newest `keep_last` that verify.
    Pinned,
    /// Kept: does not verify, and no step newer verifies.
    NotVerifyingNewer,
    /// Kept: not checked, and no step newer verifies (only from hand-made states; gc checks
    /// every step newer than the newest that verifies).
    UncheckedNewer,
    /// Deleted: verifies, but older than the newest `keep_last` that do.
    OutsideRetention,
    /// Deleted: not checked, older than the newest `keep_last` steps that verify.
    UncheckedOutsideRetention,
    /// Deleted: does not verify, and a newer step does.
    NotVerifyingOlder,
    /// Deleted: uncommitted, and its newest object is older than the leftover age.
    LeftoverOld,
    /// Kept: uncommitted but recent (may be a save in progress).
    LeftoverRecent,
}

impl std::fmt::Display for GcReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GcReason::NewestVerified => "newest step that verifies",
            GcReason::WithinKeepLast => "within keep-last",
            GcReason::KeepEvery => "multiple of keep-every",
            GcReason::Pinned => "pinned by the caller (just committed)",
            GcReason::NotVerifyingNewer => {
                "does not verify; kept for inspection, newer than every step that does"
            }
            GcReason::UncheckedNewer => "not checked; kept, newer than every step that verifies",
            GcReason::OutsideRetention => "outside retention",
            GcReason::UncheckedOutsideRetention => {
                "outside retention (not checked: keep-last met by newer steps)"
            }
            GcReason::NotVerifyingOlder => "does not verify; older than a step that does",
            GcReason::LeftoverOld => "uncommitted and old",
            GcReason::LeftoverRecent => "uncommitted but recent (may be in progress)",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GcItem {
    pub step: u64,
    pub decision: GcDecision,
    pub reason: GcReason,
    /// What gc found when it checked the step (`unchecked` for uncommitted steps).
    pub check: StepCheck,
}

/// Decides, for every step, whether it stays. Pure. Keeps the newest step that verifies even
/// under a policy [`RetentionPolicy::validate`] rejects (`keep_last` 0).
pub fn plan_gc(states: &[StepState], policy: &RetentionPolicy, now_ms: i64) -> Vec<GcItem> {
    // Steps that verify, newest first: only they count toward keep-last.
    let verifies = |s: &StepState| {
        s.committed && (s.check == StepCheck::Verified || policy.pinned == Some(s.step))
    };
    let mut verified: Vec<u64> = states
        .iter()
        .filter(|s| verifies(s))
        .map(|s| s.step)
        .collect();
    verified.sort_unstable_by(|a, b| b.cmp(a));
    verified.dedup();
    let newest_verified = verified.first().copied();
    let milestone = |step: u64| {
        policy
            .keep_every
            .is_some_and(|n| n > 0 && step.is_multiple_of(n))
    };
    let mut out: Vec<GcItem> = states
        .iter()
        .map(|s| {
            let (decision, reason) = if !s.committed {
                if now_ms.saturating_sub(s.newest_modified_ms) >= policy.leftover_age_ms_min as i64
                {
                    (GcDecision::DeleteLeftover, GcReason::LeftoverOld)
                } else {
                    (GcDecision::Keep, GcReason::LeftoverRecent)
                }
            } else if verifies(s) {
                let pos = verified.iter().position(|v| *v == s.step).unwrap_or(0);
                if pos == 0 {
                    (GcDecision::Keep, GcReason::NewestVerified)
                } else if pos < policy.keep_last {
                    (GcDecision::Keep, GcReason::WithinKeepLast)
                } else if policy.pinned == Some(s.step) {
                    (GcDecision::Keep, GcReason::Pinned)
                } else if milestone(s.step) {
                    (GcDecision::Keep, GcReason::KeepEvery)
                } else {
                    (GcDecision::DeleteCommitted, GcReason::OutsideRetention)
                }
            } else if newest_verified.is_none_or(|n| s.step > n) {
                match s.check {
                    StepCheck::Failed => (GcDecision::Keep, GcReason::NotVerifyingNewer),
                    _ => (GcDecision::Keep, GcReason::UncheckedNewer),
                }
            } else if milestone(s.step) {
                (GcDecision::Keep, GcReason::KeepEvery)
            } else {
                match s.check {
                    StepCheck::Failed => (GcDecision::DeleteCommitted, GcReason::NotVerifyingOlder),
                    _ => (
                        GcDecision::DeleteCommitted,
                        GcReason::UncheckedOutsideRetention,
                    ),
                }
            };
            GcItem {
                step: s.step,
                decision,
                reason,
                check: if s.committed {
                    s.check
                } else {
                    StepCheck::Unchecked
                },
            }
        })
        .collect();
    out.sort_by_key(|i| i.step);
    out
}

/// A committed step gc checked and found not to verify.
#[derive(Debug, Clone, Serialize)]
pub struct NotVerifying {
    pub step: u64,
    pub error: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct GcReport {
    /// How steps were checked.
    pub check: GcCheck,
    pub items: Vec<GcItem>,
    /// The steps that did not verify, and why.
    pub not_verifying: Vec<NotVerifying>,
    pub objects_deleted: usize,
    pub bytes_deleted: u64,
}

impl Store {
    /// Checks committed step `step` as `check` says: `Ok(Ok(manifest))` when it verifies,
    /// `Ok(Err(why))` on an integrity error, `Err` on any other error.
    async fn gc_check_step(
        &self,
        step: u64,
        check: GcCheck,
        cancel: &CancellationToken,
    ) -> Result<std::result::Result<Manifest, String>> {
        let present = async {
            let m = self.read_manifest(step, cancel).await?;
            self.check_objects_present(&m, cancel).await?;
            Ok::<_, Error>(m)
        }
        .await;
        let m = match present {
            Ok(m) => m,
            Err(e) if e.is_integrity() => return Ok(Err(e.to_string())),
            Err(e) => return Err(e),
        };
        if check == GcCheck::Full {
            match self.verify(step, &ReadOptions::default(), cancel).await {
                Ok(r) if r.bad.is_empty() => {}
                Ok(r) => {
                    let list: Vec<String> =
                        r.bad.iter().map(|(k, why)| format!("{k}: {why}")).collect();
                    return Ok(Err(format!(
                        "{} bad object(s): {}",
                        r.bad.len(),
                        list.join("; ")
                    )));
                }
                Err(e) if e.is_integrity() => return Ok(Err(e.to_string())),
                Err(e) => return Err(e),
            }
        }
        Ok(Ok(m))
    }

    /// Applies the retention policy. With `dry_run`, only checks and plans. Refuses a policy
    /// [`RetentionPolicy::validate`] rejects with [`Error::InvalidInput`], before it reads
    /// anything.
    pub async fn gc(
        &self,
        policy: &RetentionPolicy,
        dry_run: bool,
        cancel: &CancellationToken,
    ) -> Result<GcReport> {
        policy.validate()?;
        let now_ms = crate::save::now_unix_ms() as i64;
        let committed: BTreeSet<u64> = self.committed_steps(cancel).await?.into_iter().collect();
        let mut states = Vec::new();
        let mut listings = BTreeMap::new();
        for step in self.steps(cancel).await? {
            let objs = self.list(&format::step_dir(step), cancel).await?;
            let newest = objs.iter().map(|o| o.2).max().unwrap_or(0);
            states.push(StepState {
                step,
                committed: committed.contains(&step),
                check: StepCheck::Unchecked,
                newest_modified_ms: newest,
            });
            listings.insert(step, objs);
        }
        // Check committed steps newest first until keep_last verify: the steps kept for
        // keep-last are read, the ones deleted never are. Everything is checked before anything
        // is deleted, so an error here deletes nothing.
        let mut manifests = BTreeMap::new();
        let mut not_verifying = Vec::new();
        let mut verified = 0;
        for s in &mut states {
            if s.committed && policy.pinned == Some(s.step) {
                s.check = StepCheck::Verified;
            }
        }
        for s in states.iter_mut().rev().filter(|s| s.committed) {
            if verified >= policy.keep_last {
                break;
            }
            if s.check == StepCheck::Verified {
                // Pinned: known good to the caller.
                verified += 1;
                continue;
            }
            match self.gc_check_step(s.step, policy.check, cancel).await? {
                Ok(m) => {
                    s.check = StepCheck::Verified;
                    manifests.insert(s.step, m);
                    verified += 1;
                }
                Err(error) => {
                    tracing::warn!(step = s.step, %error, "committed step does not verify");
                    s.check = StepCheck::Failed;
                    not_verifying.push(NotVerifying {
                        step: s.step,
                        error,
                    });
                }
            }
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
                    let m = match manifests.remove(&item.step) {
                        Some(m) => m,
                        None => match self.read_manifest(item.step, cancel).await {
                            Ok(m) => m,
                            Err(e) => {
                                tracing::warn!(step = item.step, error = %e, "not cleaning a step whose manifest does not read");
                                continue;
                            }
                        },
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
                    reason = %item.reason,
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
            check: policy.check,
            items,
            not_verifying,
            objects_deleted,
            bytes_deleted,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The state of a step in `testdata/gc.json`: committed and `verified`, `failed` or
    /// `unchecked`, or `uncommitted`.
    #[derive(Debug, Clone, Copy, Deserialize)]
    #[serde(rename_all = "snake_case")]
    enum Kind {
        Verified,
        Failed,
        Unchecked,
        Uncommitted,
    }

    fn state(step: u64, kind: Kind, newest_modified_ms: i64) -> StepState {
        let (committed, check) = match kind {
            Kind::Verified => (true, StepCheck::Verified),
            Kind::Failed => (true, StepCheck::Failed),
            Kind::Unchecked => (true, StepCheck::Unchecked),
            Kind::Uncommitted => (false, StepCheck::Unchecked),
        };
        StepState {
            step,
            committed,
            check,
            newest_modified_ms,
        }
    }

    fn leftover_age_default() -> u64 {
        1_000
    }

    fn now_default() -> i64 {
        10_000
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Case {
        name: String,
        keep_last: usize,
        #[serde(default)]
        keep_every: Option<u64>,
        #[serde(default = "leftover_age_default")]
        leftover_age_ms_min: u64,
        #[serde(default = "now_default")]
        now: i64,
        #[serde(default)]
        pinned: Option<u64>,
        /// `[step, state, newest_modified_ms]`
        steps: Vec<(u64, Kind, i64)>,
        /// `[step, decision, reason]`, ascending by step.
        expect: Vec<(u64, GcDecision, GcReason)>,
    }

    fn policy(
        keep_last: usize,
        keep_every: Option<u64>,
        leftover_age_ms_min: u64,
    ) -> RetentionPolicy {
        RetentionPolicy {
            keep_last,
            keep_every,
            leftover_age_ms_min,
            check: GcCheck::Full,
            pinned: None,
        }
    }

    #[test]
    fn gc_table() {
        let text =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/gc.json"))
                .expect("read testdata/gc.json");
        let cases: Vec<Case> = serde_json::from_str(&text).expect("parse testdata/gc.json");
        assert!(cases.len() >= 20, "the table lost cases: {}", cases.len());
        let mut failures = Vec::new();
        let mut reasons = BTreeSet::new();
        for case in &cases {
            let policy = RetentionPolicy {
                pinned: case.pinned,
                ..policy(case.keep_last, case.keep_every, case.leftover_age_ms_min)
            };
            let states: Vec<StepState> = case
                .steps
                .iter()
                .map(|(step, kind, t)| state(*step, *kind, *t))
                .collect();
            let got: Vec<(u64, GcDecision, GcReason)> = plan_gc(&states, &policy, case.now)
                .into_iter()
                .map(|i| (i.step, i.decision, i.reason))
                .collect();
            if got != case.expect {
                failures.push(format!(
                    "{}:\n  expected {:?}\n  got      {:?}",
                    case.name, case.expect, got
                ));
            }
            // The order of the listing does not matter.
            let mut reversed = states.clone();
            reversed.reverse();
            assert_eq!(
                plan_gc(&reversed, &policy, case.now),
                plan_gc(&states, &policy, case.now),
                "{}",
                case.name
            );
            reasons.extend(case.expect.iter().map(|e| format!("{:?}", e.2)));
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
        assert_eq!(reasons.len(), 11, "every reason has a case: {reasons:?}");
    }

    #[test]
    fn keep_last_zero_is_refused_and_the_planner_still_keeps_the_newest_verified_step() {
        let zero = policy(0, None, 0);
        assert!(matches!(zero.validate(), Err(Error::InvalidInput(_))));
        assert!(matches!(
            policy(1, Some(0), 0).validate(),
            Err(Error::InvalidInput(_))
        ));
        policy(1, Some(1), 0).validate().unwrap();
        let plan = plan_gc(
            &[
                state(1, Kind::Verified, 0),
                state(2, Kind::Verified, 0),
                state(3, Kind::Uncommitted, 0),
            ],
            &zero,
            5,
        );
        assert_eq!(
            (plan[1].decision, plan[1].reason),
            (GcDecision::Keep, GcReason::NewestVerified)
        );
        assert_eq!(plan[0].decision, GcDecision::DeleteCommitted);
        assert_eq!(plan[2].decision, GcDecision::DeleteLeftover);
    }

    #[tokio::test]
    async fn store_gc_refuses_keep_last_zero() {
        let store = Store::open("memory://").unwrap();
        let err = store
            .gc(&policy(0, None, 0), false, &CancellationToken::new())
            .await
            .unwrap_err();
        assert!(matches!(err, Error::InvalidInput(_)), "{err}");
        assert!(err.to_string().contains("keep_last"), "{err}");
    }

    /// xorshift64: a seeded sequence, no dependency.
    struct XorShift(u64);

    impl XorShift {
        fn new(seed: u64) -> Self {
            XorShift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
        }

        fn below(&mut self, n: u64) -> u64 {
            let mut x = self.0;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            self.0 = x;
            x % n
        }
    }

    #[test]
    fn random_states_keep_the_rules() {
        const NOW: i64 = 2_000;
        for seed in 0..3_000u64 {
            let mut rng = XorShift::new(seed);
            let n = rng.below(14);
            let mut steps: Vec<u64> = (0..n).map(|_| rng.below(40)).collect();
            steps.sort_unstable();
            steps.dedup();
            let states: Vec<StepState> = steps
                .iter()
                .map(|&step| {
                    let kind = match rng.below(4) {
                        0 => Kind::Verified,
                        1 => Kind::Failed,
                        2 => Kind::Unchecked,
                        _ => Kind::Uncommitted,
                    };
                    state(step, kind, rng.below(2_000) as i64)
                })
                .collect();
            let keep_every = match rng.below(3) {
                0 => None,
                _ => Some(1 + rng.below(6)),
            };
            // Sometimes pin a step (committed or not, verified or not).
            let pinned = match (rng.below(3), steps.is_empty()) {
                (0, false) => Some(steps[rng.below(steps.len() as u64) as usize]),
                _ => None,
            };
            let policy = RetentionPolicy {
                pinned,
                ..policy(1 + rng.below(5) as usize, keep_every, rng.below(2_000))
            };
            policy.validate().unwrap();
            let plan = plan_gc(&states, &policy, NOW);
            let ctx = format!("seed {seed}: {policy:?}\n  {states:?}\n  {plan:?}");
            let item = |step: u64| plan.iter().find(|i| i.step == step).unwrap();

            assert_eq!(
                plan.iter().map(|i| i.step).collect::<Vec<_>>(),
                steps,
                "one item per step, ascending: {ctx}"
            );
            // A pinned committed step counts as verifying.
            let verifies = |s: &StepState| {
                s.committed && (s.check == StepCheck::Verified || pinned == Some(s.step))
            };
            let mut verified: Vec<u64> = states
                .iter()
                .filter(|s| verifies(s))
                .map(|s| s.step)
                .collect();
            verified.reverse();
            // The newest step that verifies is kept.
            if let Some(&newest) = verified.first() {
                assert_eq!(
                    (item(newest).decision, item(newest).reason),
                    (GcDecision::Keep, GcReason::NewestVerified),
                    "{ctx}"
                );
            }
            // At least min(keep_last, #verified) steps that verify are kept, and exactly the
            // newest of them count toward keep-last.
            let wanted = policy.keep_last.min(verified.len());
            let kept_verified = verified
                .iter()
                .filter(|s| item(**s).decision == GcDecision::Keep)
                .count();
            assert!(kept_verified >= wanted, "{ctx}");
            let counted: Vec<u64> = plan
                .iter()
                .rev()
                .filter(|i| {
                    matches!(
                        i.reason,
                        GcReason::NewestVerified | GcReason::WithinKeepLast
                    )
                })
                .map(|i| i.step)
                .collect();
            assert_eq!(counted, verified[..wanted], "{ctx}");
            // No step that does not verify counts toward keep-last: without them, the steps
            // that verify (and the uncommitted ones) are decided the same.
            let without: Vec<StepState> = states
                .iter()
                .filter(|s| !s.committed || verifies(s))
                .copied()
                .collect();
            for i in plan_gc(&without, &policy, NOW) {
                assert_eq!(&i, item(i.step), "{ctx}");
            }
            for s in &states {
                let i = item(s.step);
                if !s.committed {
                    // Uncommitted steps go by age alone.
                    let old = NOW - s.newest_modified_ms >= policy.leftover_age_ms_min as i64;
                    let want = if old {
                        GcDecision::DeleteLeftover
                    } else {
                        GcDecision::Keep
                    };
                    assert_eq!(i.decision, want, "{ctx}");
                    continue;
                }
                assert_ne!(i.decision, GcDecision::DeleteLeftover, "{ctx}");
                // Nothing committed newer than the newest step that verifies is deleted (so
                // when none verifies, no committed step is).
                if verified.first().is_none_or(|n| s.step > *n) {
                    assert_eq!(i.decision, GcDecision::Keep, "{ctx}");
                }
                // Milestones and the pinned step stay.
                if keep_every.is_some_and(|e| s.step.is_multiple_of(e)) || pinned == Some(s.step) {
                    assert_eq!(i.decision, GcDecision::Keep, "{ctx}");
                }
                if !verifies(s) {
                    assert!(
                        !matches!(
                            i.reason,
                            GcReason::NewestVerified
                                | GcReason::WithinKeepLast
                                | GcReason::OutsideRetention
                        ),
                        "{ctx}"
                    );
                }
                assert_eq!(i.check, s.check, "{ctx}");
            }
        }
    }
}
