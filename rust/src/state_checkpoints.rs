//! Recurrent-state checkpoints of hybrid models (Gated DeltaNet layers: a fixed conv + SSM
//! state per sequence instead of K/V per token), for prefix caching over that state.
//!
//! A cached KV block lets a new request skip the block's tokens only if the recurrent state
//! after them is known too. The worker keeps `count` checkpoint slots; this table says which
//! chain hash (block_manager.rs's: the whole token prefix up to a block's end) each holds.
//! Checkpoints are taken at block ends that are multiples of `interval` tokens, when the
//! step computing that block's last token is planned (`StepPlan::state_saves`); a request is
//! admitted at the deepest cached block that has one (`StepPlan::state_from`).
//!
//! Invariants: a slot holds at most one hash and a hash at most one slot; the state after a
//! token prefix depends on those tokens only, so a checkpoint stays right whichever block
//! caches its hash; it is dropped when its block leaves the prefix cache (it could never be
//! found again) and, when all slots hold one, the least recently used is overwritten. Plans
//! run in the order they are handed out and a step restores before it saves, so a slot
//! reassigned by a later plan is read by every earlier plan first.

use std::collections::{BTreeMap, HashMap};

#[derive(Debug, Default)]
pub struct StateCheckpoints {
    /// Tokens between checkpoints (a multiple of the block size); 0 = no recurrent state.
    interval: usize,
    /// Slots nobody holds.
    free: Vec<u32>,
    /// Chain hash -> the slot holding the state after it.
    slot_of: HashMap<u64, u32>,
    /// Per slot, the hash it holds and its last use tick (the key in `lru`).
    held: Vec<Option<(u64, u64)>>,
    /// Held slots by last use, oldest first.
    lru: BTreeMap<u64, u32>,
    tick: u64,
}

impl StateCheckpoints {
    pub fn new(interval: usize, count: usize) -> Self {
        StateCheckpoints {
            interval,
            free: (0..count as u32).rev().collect(),
            held: vec![None; count],
            ..Default::default()
        }
    }

    /// Whether the model has recurrent state (the scheduler's rules for it apply).
    pub fn recurrent(&self) -> bool {
        self.interval > 0
    }

    /// Whether a block ending at token `end` (exclusive) is a checkpoint position.
    pub fn at_boundary(&self, end: usize) -> bool {
        self.interval > 0 && !self.held.is_empty() && end.is_multiple_of(self.interval)
    }

    /// The slot holding the state after chain hash `hash`.
    pub fn get(&self, hash: u64) -> Option<u32> {
        self.slot_of.get(&hash).copied()
    }

    /// Marks `hash`'s checkpoint as just used (a request starts from it).
    pub fn touch(&mut self, hash: u64) {
        if let Some(&slot) = self.slot_of.get(&hash) {
            self.use_slot(slot, hash);
        }
    }

    /// A slot to save the state after `hash` into, or None when one holds it already. Takes a
    /// free slot, else the least recently used one (forgetting what it held).
    pub fn assign(&mut self, hash: u64) -> Option<u32> {
        if self.slot_of.contains_key(&hash) || self.held.is_empty() {
            return None;
        }
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                let (_, s) = self.lru.pop_first().expect("no free slot: all are held");
                let (old, _) = self.held[s as usize].take().expect("held slot");
                self.slot_of.remove(&old);
                s
            }
        };
        self.slot_of.insert(hash, slot);
        self.use_slot(slot, hash);
        Some(slot)
    }

    /// Drops the checkpoint of `hash`, if any (its block left the prefix cache).
    pub fn forget(&mut self, hash: u64) {
        if let Some(slot) = self.slot_of.remove(&hash) {
            let (_, tick) = self.held[slot as usize].take().expect("held slot");
            self.lru.remove(&tick);
            self.free.push(slot);
        }
    }

    fn use_slot(&mut self, slot: u32, hash: u64) {
        if let Some((_, tick)) = self.held[slot as usize] {
            self.lru.remove(&tick);
        }
        self.tick += 1;
        self.held[slot as usize] = Some((hash, self.tick));
        self.lru.insert(self.tick, slot);
    }

    /// Slots held (for tests and stats).
    pub fn num_held(&self) -> usize {
        self.slot_of.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_reused_least_recently_used_first() {
        let mut c = StateCheckpoints::new(32, 2);
        assert_eq!(c.assign(10), Some(0));
        assert_eq!(c.assign(11), Some(1));
        assert_eq!(c.assign(10), None, "already held");
        c.touch(10); // 11 is now the oldest
        assert_eq!(c.assign(12), Some(1));
        assert_eq!(c.get(11), None);
        assert_eq!((c.get(10), c.get(12)), (Some(0), Some(1)));
        c.forget(10);
        assert_eq!((c.get(10), c.num_held()), (None, 1));
        assert_eq!(c.assign(13), Some(0), "a forgotten slot is free again");
        assert_eq!(c.num_held(), 2);
    }

    #[test]
    fn boundaries_are_multiples_of_the_interval_and_none_without_slots() {
        let c = StateCheckpoints::new(32, 1);
        assert!(c.recurrent());
        assert!(c.at_boundary(64) && !c.at_boundary(48));
        let none = StateCheckpoints::new(32, 0);
        assert!(none.recurrent() && !none.at_boundary(64));
        assert_eq!(StateCheckpoints::new(32, 0).get(1), None);
        let mut off = StateCheckpoints::new(0, 0);
        assert!(!off.recurrent() && !off.at_boundary(0));
        assert_eq!(off.assign(5), None);
    }
}
