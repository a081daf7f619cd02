//! Per-step bookkeeping on one node: [`StepTracker`] collects the workers' `saved` reports and
//! says when every local rank of a worker group has staged a step, so the agent can hand the
//! step to [`crate::pipeline::StoreSink`].

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::PathBuf;

use crate::state::StagedPart;

/// Steps waiting for their remaining ranks. Older ones are dropped past this: a step whose
/// ranks never all report (a rank died mid-save) must not pin memory forever.
pub const PENDING_STEPS_MAX: usize = 8;

/// Collects `saved` reports until every rank of this node has reported a step.
#[derive(Debug)]
pub struct StepTracker {
    epoch: u64,
    ranks: Range<u32>,
    pending: BTreeMap<u64, BTreeMap<u32, PathBuf>>,
}

impl StepTracker {
    pub fn new(ranks: Range<u32>) -> Self {
        StepTracker {
            epoch: 0,
            ranks,
            pending: BTreeMap::new(),
        }
    }

    /// A new worker group with (maybe) new ranks: half-reported steps of the old group can
    /// never complete, so they are forgotten.
    pub fn reset(&mut self, ranks: Range<u32>) {
        self.ranks = ranks;
        self.pending.clear();
    }

    /// Records a part received from worker group `epoch`. Parts of a newer group reset the
    /// tracker to that group's ranks; parts of an older group are stale and ignored.
    pub fn record_received(
        &mut self,
        epoch: u64,
        ranks: Range<u32>,
        part: StagedPart,
    ) -> Option<Vec<StagedPart>> {
        if epoch < self.epoch {
            tracing::warn!(
                epoch,
                step = part.step,
                "saved report from a stopped worker group ignored"
            );
            return None;
        }
        if epoch > self.epoch {
            self.epoch = epoch;
            self.reset(ranks);
        }
        self.record(part)
    }

    /// Records one part; returns all parts of its step, in rank order, once the step is complete.
    pub fn record(&mut self, part: StagedPart) -> Option<Vec<StagedPart>> {
        if !self.ranks.contains(&part.rank) {
            tracing::warn!(
                rank = part.rank,
                step = part.step,
                "saved report from a foreign rank ignored"
            );
            return None;
        }
        let step = part.step;
        self.pending
            .entry(step)
            .or_default()
            .insert(part.rank, part.dir);
        let expected = self.ranks.len();
        if self.pending.get(&step).map(|m| m.len()) == Some(expected) {
            let parts = self.pending.remove(&step).unwrap_or_default();
            return Some(
                parts
                    .into_iter()
                    .map(|(rank, dir)| StagedPart { rank, step, dir })
                    .collect(),
            );
        }
        while self.pending.len() > PENDING_STEPS_MAX {
            if let Some((old, got)) = self.pending.pop_first() {
                tracing::warn!(step = old, ranks = got.len(), "incomplete step dropped");
            }
        }
        None
    }
}

/// Keeps committed steps under a local directory.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracker_completes_a_step_when_every_local_rank_reported() {
        let mut t = StepTracker::new(4..6);
        let p = |rank, step| StagedPart {
            rank,
            step,
            dir: format!("/s/{step}/{rank}").into(),
        };
        assert!(t.record(p(4, 10)).is_none());
        assert!(t.record(p(4, 20)).is_none());
        assert!(
            t.record(p(9, 10)).is_none(),
            "foreign rank must not complete a step"
        );
        let done = t.record(p(5, 10)).unwrap();
        assert_eq!(done.iter().map(|p| p.rank).collect::<Vec<_>>(), vec![4, 5]);
        assert!(done.iter().all(|p| p.step == 10));
        // Reset forgets the half-reported step 20.
        t.reset(0..2);
        assert!(t.record(p(0, 20)).is_none());
        assert!(t.record(p(1, 20)).is_some());
    }

    #[test]
    fn tracker_forgets_parts_of_an_older_worker_group() {
        let mut t = StepTracker::new(0..0);
        let p = |rank| StagedPart {
            rank,
            step: 10,
            dir: "/s".into(),
        };
        assert!(t.record_received(1, 0..2, p(0)).is_none());
        // The group restarted (epoch 2) before rank 1 saved: rank 0's old part is gone.
        assert!(t.record_received(2, 0..2, p(1)).is_none());
        // A late report from epoch 1 is ignored.
        assert!(t.record_received(1, 0..2, p(0)).is_none());
        assert_eq!(t.record_received(2, 0..2, p(0)).unwrap().len(), 2);
    }

    #[test]
    fn tracker_bounds_incomplete_steps() {
        let mut t = StepTracker::new(0..2);
        for step in 0..100 {
            t.record(StagedPart {
                rank: 0,
                step,
                dir: "/x".into(),
            });
        }
        assert!(t.pending.len() <= PENDING_STEPS_MAX);
        assert!(
            t.record(StagedPart {
                rank: 1,
                step: 99,
                dir: "/x".into()
            })
            .is_some()
        );
    }
}
