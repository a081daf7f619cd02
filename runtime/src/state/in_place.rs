//! Recovery in place, as the agent's shared state keeps it: which local workers watch for
//! generations (`watch`), the generation offered to them, who switched to it (`switched`; the
//! last one makes the node run it), and a collective failure a worker reported
//! (`collective_failed`). The agent loop (`agent/group.rs`) makes and takes back offers; the
//! socket answers the requests through [`AgentState::handle_line`].

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::time::Instant;

use worker::protocol::Reply;

use super::{AgentState, Inner, check_rank};

/// The most of a worker's reason for a failed collective that the agent keeps.
const COLLECTIVE_FAILURE_REASON_BYTES_MAX: usize = 512;

/// A generation offered to the running workers, to switch to in place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InPlaceOffer {
    pub generation: u64,
    pub world_size: u32,
    /// This node's global ranks in it.
    pub ranks: Range<u32>,
    /// The environment variables that change with the generation, as a new worker of it
    /// would get them (the `generation` reply's `env`).
    pub env: BTreeMap<String, String>,
}

/// The running worker group's part in recovery in place; reset with each new group.
#[derive(Debug, Default)]
pub(super) struct InPlace {
    /// Local ranks (index from the group's first rank) that watch for generations: when all
    /// of them do, a new generation is offered instead of a restart.
    watching: BTreeSet<u32>,
    /// The generation offered, and the local ranks that switched to it.
    offer: Option<InPlaceOffer>,
    switched: BTreeSet<u32>,
    /// The highest step reported before the last switch completed.
    step_before_switch: Option<u64>,
    /// A collective failure a worker reported for the running generation, not yet acted on.
    collective_failed: Option<(u64, String)>,
}

impl AgentState {
    /// Wakes held `watch` requests and the agent loop.
    pub(super) fn in_place_changed(&self) {
        self.in_place_changes.send_modify(|v| *v += 1);
    }

    /// Whether every worker of the running group watches for generations to switch to in
    /// place (and no switch is under way).
    pub fn workers_switch_in_place(&self) -> bool {
        let s = self.lock();
        let p = &s.in_place;
        !s.ranks.is_empty() && p.watching.len() == s.ranks.len() && p.offer.is_none()
    }

    /// Whether any worker of the running group watches for generations to switch to.
    pub fn watching_any(&self) -> bool {
        !self.lock().in_place.watching.is_empty()
    }

    /// Offers `offer` to the running workers: their held `watch` requests are answered with
    /// it. A newer offer replaces an older one that not every rank switched to yet.
    pub fn offer_in_place(&self, offer: InPlaceOffer) {
        let mut s = self.lock();
        s.in_place.offer = Some(offer);
        s.in_place.switched.clear();
        drop(s);
        self.in_place_changed();
    }

    /// The offer made, while not every local rank switched to it yet.
    pub fn pending_offer(&self) -> Option<u64> {
        self.lock().in_place.offer.as_ref().map(|o| o.generation)
    }

    /// Takes back an offer the workers did not switch to in time (the agent restarts them
    /// instead); returns whether one was pending.
    pub fn withdraw_offer(&self) -> bool {
        let mut s = self.lock();
        let had = s.in_place.offer.take().is_some();
        s.in_place.switched.clear();
        drop(s);
        self.in_place_changed();
        had
    }

    /// A collective failure a worker reported (the generation, and why), once.
    pub fn take_collective_failure(&self) -> Option<(u64, String)> {
        self.lock().in_place.collective_failed.take()
    }

    /// The highest step the workers reported before their last switch in place.
    pub fn step_before_switch(&self) -> Option<u64> {
        self.lock().in_place.step_before_switch
    }

    /// Resolves when an offer is made or withdrawn, or a switch completes.
    pub fn in_place_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.in_place_changes.subscribe()
    }
}

impl Inner {
    /// `watch` from rank `rank`, which runs `generation`: the offer when there is one for
    /// another generation (with the worker's rank in it), else `generation` itself with no env
    /// (nothing new; the socket holds such an answer until something changes).
    pub(super) fn watch(&mut self, rank: u32, generation: u64) -> Result<Reply, String> {
        // The rank is the worker's rank in the generation it says it runs: the offered one
        // once it switched, else the node's current one.
        let range = match &self.in_place.offer {
            Some(o) if o.generation == generation => o.ranks.clone(),
            _ => self.ranks.clone(),
        };
        check_rank(&range, rank)?;
        let local = rank - range.start;
        self.in_place.watching.insert(local);
        Ok(match &self.in_place.offer {
            Some(o) if o.generation != generation => Reply::Generation {
                generation: o.generation,
                rank_offset: o.ranks.start,
                rank: o.ranks.start + local,
                env: o.env.clone(),
            },
            offer => {
                let start = offer.as_ref().map_or(self.ranks.start, |o| o.ranks.start);
                Reply::Generation {
                    generation,
                    rank_offset: start,
                    rank: start + local,
                    env: Default::default(),
                }
            }
        })
    }

    /// `switched` from rank `rank` (its rank in `generation`). Returns whether that completed
    /// the switch: every local rank switched, and the node now runs the offered generation
    /// (its ranks, world size, and a new epoch for the parts).
    pub(super) fn switched(&mut self, rank: u32, generation: u64) -> Result<bool, String> {
        if self.generation == generation && self.in_place.offer.is_none() {
            // Said again after the switch completed.
            check_rank(&self.ranks, rank)?;
            return Ok(false);
        }
        let Some(o) = &self.in_place.offer else {
            return Err(format!(
                "no switch to generation {generation} was offered (the node runs generation {})",
                self.generation
            ));
        };
        if o.generation != generation {
            return Err(format!(
                "generation {generation} is not the one offered ({})",
                o.generation
            ));
        }
        check_rank(&o.ranks, rank)?;
        let (local, all) = (rank - o.ranks.start, o.ranks.len());
        self.in_place.switched.insert(local);
        if self.in_place.switched.len() < all {
            return Ok(false);
        }
        let o = self.in_place.offer.take().expect("checked");
        self.generation = o.generation;
        self.world_size = o.world_size;
        self.ranks = o.ranks;
        // Parts from now on are the new group's: half-reported old steps are forgotten (they
        // can never be committed).
        self.epoch += 1;
        self.in_place.switched.clear();
        self.last_saves.clear();
        self.peer_stop = None;
        // The new generation's steps are reported afresh (its first step).
        self.in_place.step_before_switch = self.last_step.take();
        self.in_place.collective_failed = None;
        self.last_progress = Some(Instant::now());
        Ok(true)
    }

    /// `collective_failed` from rank `rank` in `generation`: kept (once per generation, its
    /// reason cut short) for the agent loop to ask etcd to regroup. Returns whether it was.
    pub(super) fn collective_failed(
        &mut self,
        rank: u32,
        generation: u64,
        reason: &str,
    ) -> Result<bool, String> {
        check_rank(&self.ranks, rank)?;
        if generation != self.generation || self.in_place.collective_failed.is_some() {
            return Ok(false);
        }
        let mut end = reason.len().min(COLLECTIVE_FAILURE_REASON_BYTES_MAX);
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        self.in_place.collective_failed =
            Some((generation, format!("rank {rank}: {}", &reason[..end])));
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use worker::protocol::Request;

    use super::*;

    #[test]
    fn a_generation_is_offered_in_place_once_every_rank_watches_and_taken_when_all_switched() {
        let state = AgentState::new(PathBuf::from("/staging"));
        state.begin_group(2, 4, 2..4);
        let reply = |r: Request| state.handle(r).map(|(reply, _)| reply);
        let progress = |rank, step| Request::Progress { rank, step };
        let nothing_new = |generation, rank_offset, rank| Reply::Generation {
            generation,
            rank_offset,
            rank,
            env: Default::default(),
        };
        // Nothing offered: a watch hears its own generation back.
        assert_eq!(
            reply(Request::Watch {
                rank: 2,
                generation: 2
            }),
            Ok(nothing_new(2, 2, 2))
        );
        assert!(!state.workers_switch_in_place(), "rank 3 does not watch");
        assert!(
            reply(Request::Watch {
                rank: 0,
                generation: 2
            })
            .is_err(),
            "a foreign rank"
        );
        reply(Request::Watch {
            rank: 3,
            generation: 2,
        })
        .unwrap();
        assert!(state.workers_switch_in_place());
        // Generation 3 puts this node's ranks at 0..2 of a world of 2.
        let env: std::collections::BTreeMap<String, String> =
            [("WORLD_SIZE".to_string(), "2".to_string())].into();
        let mut changes = state.in_place_changes();
        state.offer_in_place(InPlaceOffer {
            generation: 3,
            world_size: 2,
            ranks: 0..2,
            env: env.clone(),
        });
        assert!(changes.has_changed().unwrap());
        changes.mark_unchanged();
        assert_eq!(state.pending_offer(), Some(3));
        let offer = Reply::Generation {
            generation: 3,
            rank_offset: 0,
            rank: 1,
            env,
        };
        assert_eq!(
            reply(Request::Watch {
                rank: 3,
                generation: 2
            }),
            Ok(offer.clone())
        );
        // A rank that switched watches with its new rank and hears nothing new.
        assert_eq!(
            reply(Request::Watch {
                rank: 1,
                generation: 3
            }),
            Ok(nothing_new(3, 0, 1))
        );
        assert!(
            reply(Request::Watch {
                rank: 3,
                generation: 3
            })
            .is_err(),
            "rank 3 is not in generation 3"
        );
        assert!(
            reply(Request::Switched {
                rank: 1,
                generation: 4
            })
            .is_err(),
            "not the generation offered"
        );
        assert!(
            reply(Request::Switched {
                rank: 3,
                generation: 3
            })
            .is_err(),
            "a rank outside the offer"
        );
        state.handle(progress(2, 17)).unwrap();
        reply(Request::Switched {
            rank: 0,
            generation: 3,
        })
        .unwrap();
        // Half switched: the node still runs generation 2, and old-rank saves are its own.
        assert_eq!((state.generation(), state.world_size()), (2, 4));
        assert!(!changes.has_changed().unwrap());
        reply(Request::Switched {
            rank: 1,
            generation: 3,
        })
        .unwrap();
        assert!(changes.has_changed().unwrap());
        assert_eq!((state.generation(), state.world_size()), (3, 2));
        assert_eq!(state.pending_offer(), None);
        assert_eq!(state.step_before_switch(), Some(17));
        assert_eq!(
            state.last_step(),
            None,
            "the new generation's first step is still to come"
        );
        assert!(state.handle(progress(2, 18)).is_err(), "old ranks are gone");
        state.handle(progress(1, 18)).unwrap();
        // Said again: fine. A withdrawn offer is no longer answered.
        reply(Request::Switched {
            rank: 1,
            generation: 3,
        })
        .unwrap();
        state.offer_in_place(InPlaceOffer {
            generation: 4,
            world_size: 4,
            ranks: 2..4,
            env: [("WORLD_SIZE".to_string(), "4".to_string())].into(),
        });
        assert!(state.withdraw_offer());
        assert_eq!(
            reply(Request::Watch {
                rank: 0,
                generation: 3
            }),
            Ok(nothing_new(3, 0, 0))
        );
        assert!(
            reply(Request::Switched {
                rank: 2,
                generation: 4
            })
            .is_err()
        );
    }
}
