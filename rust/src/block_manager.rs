//! Paged KV-cache block manager with automatic prefix caching (vLLM's scheme).
//!
//! The KV cache is `num_blocks` blocks of `block_size` token slots. A sequence owns a block
//! table (a list of block ids, stored on the `Sequence`); token position `p` of the sequence
//! lives in KV slot `table[p / block_size] * block_size + p % block_size`.
//!
//! Prefix caching: a full block whose K/V is computed can be `register`ed under its chain hash,
//! `H(parent block's hash, its token ids)`. A later sequence whose prompt starts with the same
//! tokens `lookup`s its blocks one after another and takes them into its table instead of
//! computing them (a block then sits in several tables: `refs` counts them). A block no table
//! holds stays cached, "evictable", until `grow` needs room: the free list is used first, then
//! the least recently released cached block is evicted (its contents forgotten).
//!
//! Invariants:
//! - every block id in `[0, num_blocks)` is in exactly one state: held (`refs > 0`, in that
//!   many tables), free (`refs == 0`, no contents, in `free`) or evictable (`refs == 0`, cached
//!   contents, in `lru`); never in two, and `free.len() + lru.len()` blocks can be allocated;
//! - `cached` maps a chain hash to the one block holding those contents (`content[b]`);
//! - a cached block is never written: its tokens are positions every table holding it has
//!   computed, and sequences only write positions they have not computed;
//! - a block table of a sequence holding `n` tokens has at least `ceil(n / block_size)` blocks.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{Hash, Hasher};

use crate::error::{Error, Result};
use crate::state_checkpoints::StateCheckpoints;

/// The chain hash of the block before a sequence's first block.
pub const ROOT_HASH: u64 = 0x6561_676c_6562_6174; // "eaglebat"

/// The chain hash of a full block: its parent's chain hash and its token ids.
pub fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = std::hash::DefaultHasher::new(); // SipHash with fixed keys: same every run
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// What a cached block holds: checked on lookup, so a hash collision never shares a block.
#[derive(Debug)]
struct Content {
    hash: u64,
    parent: u64,
    tokens: Box<[u32]>,
    /// The token after the block in the sequence that registered it (None: not known then).
    next: Option<u32>,
}

#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    num_blocks: usize,
    /// Whether `register` caches anything (engine.prefix_caching).
    caching: bool,
    /// Blocks with no table and no contents. Allocation pops from the front, freeing pushes to
    /// the back (recently freed blocks are reused last, so a worker's use-after-free shows).
    free: VecDeque<u32>,
    /// Tables holding each block.
    refs: Vec<u32>,
    /// Cached contents of each block (None: not cached).
    content: Vec<Option<Content>>,
    /// Chain hash -> the block caching it.
    cached: HashMap<u64, u32>,
    /// Evictable blocks (cached, no table) by release tick, oldest first.
    lru: BTreeMap<u64, u32>,
    /// The tick under which an evictable block sits in `lru`.
    released_at: Vec<u64>,
    tick: u64,
    /// Cached blocks evicted so far.
    pub evictions: u64,
    /// Recurrent-state checkpoints of the cached blocks' hashes (hybrid models; empty else),
    /// dropped with their block.
    pub states: StateCheckpoints,
}

impl BlockManager {
    pub fn new(num_blocks: usize, block_size: usize, caching: bool) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        BlockManager {
            block_size,
            num_blocks,
            caching,
            free: (0..num_blocks as u32).collect(),
            refs: vec![0; num_blocks],
            content: (0..num_blocks).map(|_| None).collect(),
            cached: HashMap::new(),
            lru: BTreeMap::new(),
            released_at: vec![0; num_blocks],
            tick: 0,
            evictions: 0,
            states: StateCheckpoints::default(),
        }
    }

    /// The manager with recurrent-state checkpoints `states` (hybrid models).
    pub fn with_states(mut self, states: StateCheckpoints) -> Self {
        self.states = states;
        self
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn caching(&self) -> bool {
        self.caching
    }

    /// Blocks `grow` can hand out: free ones and evictable cached ones.
    pub fn num_free_blocks(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// Blocks holding cached contents (held or evictable).
    pub fn num_cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// Blocks needed to hold `num_tokens` tokens.
    pub fn blocks_needed(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// The block caching the full block `tokens` after a block of chain hash `parent`, whose
    /// own chain hash is `hash`, if one does.
    pub fn lookup(&self, parent: u64, hash: u64, tokens: &[u32]) -> Option<u32> {
        let &b = self.cached.get(&hash)?;
        let c = self.content[b as usize].as_ref()?;
        (c.parent == parent && *c.tokens == *tokens).then_some(b)
    }

    /// The token that followed cached block `block` when it was registered.
    pub fn next_token(&self, block: u32) -> Option<u32> {
        self.content[block as usize].as_ref().and_then(|c| c.next)
    }

    /// Whether a fresh sequence of `num_tokens` tokens whose first blocks are the cached
    /// `prefix` fits while keeping `reserve` blocks allocatable.
    pub fn can_allocate(&self, num_tokens: usize, prefix: &[u32], reserve: usize) -> bool {
        let new = self.blocks_needed(num_tokens).saturating_sub(prefix.len());
        // evictable prefix blocks stop being allocatable once the sequence holds them
        let revived = prefix
            .iter()
            .filter(|&&b| self.refs[b as usize] == 0)
            .count();
        new + reserve + revived <= self.num_free_blocks()
    }

    /// Extra blocks a table needs so that it can hold `num_tokens` tokens.
    pub fn blocks_to_grow(&self, table: &[u32], num_tokens: usize) -> usize {
        self.blocks_needed(num_tokens).saturating_sub(table.len())
    }

    /// Gives an empty table the blocks `prefix` (cached ones from `lookup`, or blocks another
    /// table holds: a sample forked from its sibling), then blocks for the rest of `num_tokens`
    /// tokens.
    pub fn allocate(
        &mut self,
        table: &mut Vec<u32>,
        prefix: &[u32],
        num_tokens: usize,
    ) -> Result<()> {
        if !table.is_empty() {
            return Err(Error::internal(
                "allocate() on a sequence that already holds blocks",
            ));
        }
        if !self.can_allocate(num_tokens, prefix, 0) {
            return Err(Error::internal(format!(
                "out of KV blocks for {num_tokens} tokens ({} cached), {} free",
                prefix.len(),
                self.num_free_blocks()
            )));
        }
        for &b in prefix {
            if self.content[b as usize].is_none() && self.refs[b as usize] == 0 {
                return Err(Error::internal(format!(
                    "block {b} is neither cached nor held"
                )));
            }
            if self.refs[b as usize] == 0 {
                self.lru.remove(&self.released_at[b as usize]);
            }
            self.refs[b as usize] += 1;
            table.push(b);
        }
        self.grow(table, num_tokens)
    }

    /// Appends blocks to `table` until it can hold `num_tokens` tokens: free ones first, then
    /// the least recently released cached ones (their contents are forgotten).
    pub fn grow(&mut self, table: &mut Vec<u32>, num_tokens: usize) -> Result<()> {
        let need = self.blocks_to_grow(table, num_tokens);
        if need > self.num_free_blocks() {
            return Err(Error::internal(format!(
                "out of KV blocks: need {need}, {} free",
                self.num_free_blocks()
            )));
        }
        for _ in 0..need {
            let block = match self.free.pop_front() {
                Some(b) => b,
                None => self.evict_oldest(),
            };
            debug_assert_eq!(
                self.refs[block as usize], 0,
                "block {block} handed out twice"
            );
            self.refs[block as usize] = 1;
            table.push(block);
        }
        Ok(())
    }

    /// Forgets the contents of the least recently released cached block and returns it.
    fn evict_oldest(&mut self) -> u32 {
        let (_, block) = self
            .lru
            .pop_first()
            .expect("caller checked num_free_blocks");
        let c = self.content[block as usize]
            .take()
            .expect("evictable blocks are cached");
        self.cached.remove(&c.hash);
        self.states.forget(c.hash);
        self.evictions += 1;
        block
    }

    /// Drops `table`'s hold on its blocks and empties it. A block no table holds any more goes
    /// back to the free list, or, if cached, becomes evictable; the table's last blocks are
    /// released first, so they are evicted before its first ones (which more sequences share).
    pub fn free(&mut self, table: &mut Vec<u32>) -> Result<()> {
        for &block in table.iter().rev() {
            let refs = self.refs.get_mut(block as usize).ok_or_else(|| {
                Error::internal(format!("free of block {block} outside [0, num_blocks)"))
            })?;
            if *refs == 0 {
                return Err(Error::internal(format!("double free of KV block {block}")));
            }
            *refs -= 1;
            if *refs > 0 {
                continue;
            }
            if self.content[block as usize].is_some() {
                self.tick += 1;
                self.released_at[block as usize] = self.tick;
                self.lru.insert(self.tick, block);
            } else {
                self.free.push_back(block);
            }
        }
        table.clear();
        Ok(())
    }

    /// Caches held block `block` as the full block `tokens` (chain hash `hash`, parent chain
    /// hash `parent`, followed by token `next` where known), whose K/V the caller guarantees is
    /// computed and final. No-op when
    /// caching is off, when the block is cached already, or when another block caches the
    /// same hash (the duplicate stays uncached and is freed normally).
    pub fn register(
        &mut self,
        block: u32,
        parent: u64,
        hash: u64,
        tokens: &[u32],
        next: Option<u32>,
    ) -> Result<()> {
        if tokens.len() != self.block_size || self.refs.get(block as usize) == Some(&0) {
            return Err(Error::internal(format!(
                "register of block {block}: {} tokens, held: {}",
                tokens.len(),
                self.refs.get(block as usize).is_some_and(|&r| r > 0)
            )));
        }
        if !self.caching || self.content[block as usize].is_some() {
            return Ok(());
        }
        if self.cached.contains_key(&hash) {
            return Ok(());
        }
        self.cached.insert(hash, block);
        self.content[block as usize] = Some(Content {
            hash,
            parent,
            tokens: tokens.into(),
            next,
        });
        Ok(())
    }

    /// KV slot index of token position `pos` of a sequence with block table `table`.
    pub fn slot(&self, table: &[u32], pos: usize) -> i64 {
        let block = table[pos / self.block_size] as i64;
        block * self.block_size as i64 + (pos % self.block_size) as i64
    }

    /// Checks that no table holds a block any more (nothing owned, nothing lost).
    pub fn check_no_leak(&self) -> Result<()> {
        let held = self.refs.iter().filter(|&&r| r > 0).count();
        if held != 0 || self.num_free_blocks() != self.num_blocks {
            return Err(Error::internal(format!(
                "KV block leak: {held} blocks still held, {} of {} free",
                self.num_free_blocks(),
                self.num_blocks
            )));
        }
        self.check_states()
    }

    /// Checks the three-state invariant of the module doc over every block.
    pub fn check_states(&self) -> Result<()> {
        let mut in_free = vec![false; self.num_blocks];
        for &b in &self.free {
            in_free[b as usize] = true;
        }
        let in_lru: std::collections::HashSet<u32> = self.lru.values().copied().collect();
        for (b, &free) in in_free.iter().enumerate() {
            let (held, cached) = (self.refs[b] > 0, self.content[b].is_some());
            let state = (held, free, in_lru.contains(&(b as u32)));
            let ok = match state {
                (true, false, false) => true,
                (false, true, false) => !cached,
                (false, false, true) => cached,
                _ => false,
            };
            if !ok {
                return Err(Error::internal(format!(
                    "block {b}: held {held}, free {}, evictable {}, cached {cached}",
                    state.1, state.2
                )));
            }
            if let Some(c) = &self.content[b] {
                if self.cached.get(&c.hash) != Some(&(b as u32)) {
                    return Err(Error::internal(format!(
                        "block {b}: not the one cached for its hash"
                    )));
                }
            }
        }
        if self.free.len() + in_lru.len() + self.refs.iter().filter(|&&r| r > 0).count()
            != self.num_blocks
            || self.cached.len() != self.content.iter().flatten().count()
        {
            return Err(Error::internal("block states do not add up"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn blocks_needed_rounds_up() {
        let bm = BlockManager::new(8, 4, false);
        assert_eq!(bm.blocks_needed(0), 0);
        assert_eq!(bm.blocks_needed(1), 1);
        assert_eq!(bm.blocks_needed(4), 1);
        assert_eq!(bm.blocks_needed(5), 2);
    }

    #[test]
    fn allocate_grow_free_no_leak() {
        let mut bm = BlockManager::new(8, 4, false);
        let mut a = Vec::new();
        let mut b = Vec::new();
        bm.allocate(&mut a, &[], 5).unwrap();
        assert_eq!(a.len(), 2);
        bm.allocate(&mut b, &[], 4).unwrap();
        assert_eq!(bm.num_free_blocks(), 5);
        // Growing within the last block takes nothing; crossing a boundary takes one block.
        bm.grow(&mut b, 4).unwrap();
        assert_eq!(b.len(), 1);
        bm.grow(&mut b, 5).unwrap();
        assert_eq!(b.len(), 2);
        assert_eq!(bm.num_free_blocks(), 4);
        assert!(bm.can_allocate(16, &[], 0));
        assert!(!bm.can_allocate(17, &[], 0));
        assert!(!bm.can_allocate(16, &[], 1));
        bm.free(&mut a).unwrap();
        bm.free(&mut b).unwrap();
        assert!(a.is_empty() && b.is_empty());
        bm.check_no_leak().unwrap();
    }

    #[test]
    fn out_of_blocks_is_an_error_not_a_panic() {
        let mut bm = BlockManager::new(2, 4, false);
        let mut a = Vec::new();
        assert!(bm.allocate(&mut a, &[], 9).is_err());
        assert!(a.is_empty());
        bm.check_no_leak().unwrap();
    }

    #[test]
    fn double_free_detected() {
        let mut bm = BlockManager::new(2, 4, false);
        let mut a = Vec::new();
        bm.allocate(&mut a, &[], 3).unwrap();
        let mut copy = a.clone();
        bm.free(&mut a).unwrap();
        assert!(bm.free(&mut copy).is_err());
    }

    #[test]
    fn slot_mapping() {
        let mut bm = BlockManager::new(4, 4, false);
        let mut burn = Vec::new();
        bm.allocate(&mut burn, &[], 4).unwrap(); // takes block 0
        let mut t = Vec::new();
        bm.allocate(&mut t, &[], 6).unwrap(); // blocks 1, 2
        assert_eq!(t, vec![1, 2]);
        assert_eq!(bm.slot(&t, 0), 4);
        assert_eq!(bm.slot(&t, 3), 7);
        assert_eq!(bm.slot(&t, 4), 8);
        assert_eq!(bm.slot(&t, 5), 9);
    }

    /// Random alloc/grow/free cycles: a block is never in two live tables, and after freeing
    /// everything all blocks are free again.
    /// A deterministic xorshift generator: `rand(n)` is in [0, n).
    fn xorshift(mut state: u64) -> impl FnMut(u64) -> u64 {
        move |n| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        }
    }

    #[test]
    fn randomized_cycles_never_hand_out_a_block_twice() {
        let mut bm = BlockManager::new(32, 3, false);
        let mut tables: Vec<(Vec<u32>, usize)> = Vec::new();
        let mut rand = xorshift(0x1234_5678_u64);
        for _ in 0..5000 {
            match rand(3) {
                0 => {
                    let n = 1 + rand(20) as usize;
                    if bm.can_allocate(n, &[], 0) {
                        let mut t = Vec::new();
                        bm.allocate(&mut t, &[], n).unwrap();
                        tables.push((t, n));
                    }
                }
                1 if !tables.is_empty() => {
                    let i = rand(tables.len() as u64) as usize;
                    let (t, n) = &mut tables[i];
                    if bm.blocks_to_grow(t, *n + 1) <= bm.num_free_blocks() {
                        *n += 1;
                        bm.grow(t, *n).unwrap();
                        assert_eq!(t.len(), bm.blocks_needed(*n));
                    }
                }
                _ if !tables.is_empty() => {
                    let i = rand(tables.len() as u64) as usize;
                    let (mut t, _) = tables.swap_remove(i);
                    bm.free(&mut t).unwrap();
                }
                _ => {}
            }
            let mut seen = HashSet::new();
            for (t, _) in &tables {
                for &b in t {
                    assert!(seen.insert(b), "block {b} in two tables");
                }
            }
            assert_eq!(seen.len() + bm.num_free_blocks(), 32);
        }
        for (mut t, _) in tables.drain(..) {
            bm.free(&mut t).unwrap();
        }
        bm.check_no_leak().unwrap();
    }

    /// Registers the full blocks of `tokens` held in `table`; returns their chain hashes.
    fn register_all(bm: &mut BlockManager, table: &[u32], tokens: &[u32]) -> Vec<u64> {
        let mut parent = ROOT_HASH;
        let mut hashes = Vec::new();
        for (j, chunk) in tokens.chunks_exact(bm.block_size()).enumerate() {
            let h = chain_hash(parent, chunk);
            bm.register(table[j], parent, h, chunk, None).unwrap();
            hashes.push(h);
            parent = h;
        }
        hashes
    }

    /// The cached blocks matching the full blocks of `tokens`, in order.
    fn lookup_all(bm: &BlockManager, tokens: &[u32]) -> Vec<u32> {
        let mut parent = ROOT_HASH;
        let mut found = Vec::new();
        for chunk in tokens.chunks_exact(bm.block_size()) {
            let h = chain_hash(parent, chunk);
            match bm.lookup(parent, h, chunk) {
                Some(b) => found.push(b),
                None => break,
            }
            parent = h;
        }
        found
    }

    #[test]
    fn shared_prefix_blocks_are_counted_and_survive_their_first_owner() {
        let mut bm = BlockManager::new(8, 2, true);
        let prompt = [1, 2, 3, 4, 5];
        let mut a = Vec::new();
        bm.allocate(&mut a, &[], 5).unwrap();
        register_all(&mut bm, &a, &prompt[..4]);
        assert_eq!(bm.num_cached_blocks(), 2);
        // b shares [1, 2], [3, 4] and then differs
        let b_tokens = [1, 2, 3, 4, 9, 9, 9];
        let prefix = lookup_all(&bm, &b_tokens);
        assert_eq!(prefix, a[..2]);
        assert!(bm.can_allocate(7, &prefix, 0));
        let mut b = Vec::new();
        bm.allocate(&mut b, &prefix, 7).unwrap();
        assert_eq!(b[..2], a[..2]);
        assert_eq!(bm.num_free_blocks(), 8 - 3 - 2); // a: 3 blocks, b: 2 more
        bm.check_states().unwrap();
        bm.free(&mut a).unwrap(); // still held by b: nothing becomes allocatable but a's tail
        assert_eq!(bm.num_free_blocks(), 4);
        bm.free(&mut b).unwrap();
        assert_eq!(bm.num_free_blocks(), 8);
        assert_eq!(bm.num_cached_blocks(), 2); // evictable, still found
        assert_eq!(lookup_all(&bm, &prompt[..4]).len(), 2);
        bm.check_no_leak().unwrap();
    }

    #[test]
    fn a_differing_token_or_parent_is_no_match() {
        let mut bm = BlockManager::new(8, 2, true);
        let mut a = Vec::new();
        bm.allocate(&mut a, &[], 4).unwrap();
        register_all(&mut bm, &a, &[1, 2, 3, 4]);
        assert_eq!(lookup_all(&bm, &[1, 2, 3, 5]).len(), 1);
        assert_eq!(lookup_all(&bm, &[0, 2, 3, 4]).len(), 0);
        // [3, 4] at the start has another parent: not a's second block
        assert_eq!(lookup_all(&bm, &[3, 4]).len(), 0);
        // a forged hash naming a's block with other tokens is refused by the contents check
        let h = chain_hash(ROOT_HASH, &[1, 2]);
        assert_eq!(bm.lookup(ROOT_HASH, h, &[1, 7]), None);
        assert_eq!(bm.lookup(7, h, &[1, 2]), None);
    }

    #[test]
    fn eviction_takes_free_blocks_first_then_the_least_recently_released() {
        let mut bm = BlockManager::new(4, 1, true);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        bm.allocate(&mut a, &[], 2).unwrap(); // blocks 0, 1
        register_all(&mut bm, &a, &[10, 11]);
        bm.allocate(&mut b, &[], 1).unwrap(); // block 2
        register_all(&mut bm, &b, &[20]);
        bm.free(&mut a).unwrap(); // released tail first: 1 then 0
        bm.free(&mut b).unwrap(); // 2 released last
        assert_eq!((bm.num_free_blocks(), bm.num_cached_blocks()), (4, 3));
        let mut c = Vec::new();
        bm.allocate(&mut c, &[], 2).unwrap(); // free block 3, then evicts 1 (oldest)
        assert_eq!(c, vec![3, 1]);
        assert_eq!(bm.evictions, 1);
        assert_eq!(lookup_all(&bm, &[10, 11]), vec![0]); // [10] is still there, [11] gone
        assert_eq!(lookup_all(&bm, &[20]), vec![2]);
        bm.check_states().unwrap();
        // a cached prefix taken from the evictable set is not counted as allocatable twice
        assert!(bm.can_allocate(2, &[0, 2], 0));
        assert!(!bm.can_allocate(3, &[0, 2], 0));
        let mut d = Vec::new();
        bm.allocate(&mut d, &[0, 2], 2).unwrap();
        assert_eq!(bm.num_free_blocks(), 0);
        bm.check_states().unwrap();
        for t in [&mut c, &mut d] {
            bm.free(t).unwrap();
        }
        bm.check_no_leak().unwrap();
    }

    #[test]
    fn a_duplicate_block_stays_uncached_and_caching_off_caches_nothing() {
        let mut bm = BlockManager::new(4, 2, true);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        bm.allocate(&mut a, &[], 2).unwrap();
        bm.allocate(&mut b, &[], 2).unwrap();
        register_all(&mut bm, &a, &[1, 2]);
        register_all(&mut bm, &b, &[1, 2]); // computed twice in one step: b's copy is not kept
        assert_eq!(bm.num_cached_blocks(), 1);
        bm.free(&mut b).unwrap();
        bm.free(&mut a).unwrap();
        bm.check_no_leak().unwrap();
        assert!(bm.register(0, ROOT_HASH, 1, &[1, 2], None).is_err()); // not held
        let mut off = BlockManager::new(4, 2, false);
        let mut c = Vec::new();
        off.allocate(&mut c, &[], 2).unwrap();
        register_all(&mut off, &c, &[1, 2]);
        assert_eq!(off.num_cached_blocks(), 0);
        let mut d = Vec::new();
        off.allocate(&mut d, &[c[0]], 4).unwrap(); // held by c: shared all the same
        assert_eq!((d[0], off.refs[c[0] as usize]), (c[0], 2));
        off.free(&mut c).unwrap();
        off.free(&mut d).unwrap();
        off.check_no_leak().unwrap();
        assert!(off.allocate(&mut Vec::new(), &[0], 2).is_err()); // neither cached nor held
    }

    /// Random sequences over a small vocabulary (so prefixes repeat) allocate with whatever
    /// prefix is cached, register their blocks, grow and free: the states stay consistent, a
    /// held block is never handed out again, and every shared block holds the right tokens.
    #[test]
    fn randomized_sharing_and_eviction_keep_the_invariants() {
        let bs = 2;
        let mut bm = BlockManager::new(24, bs, true);
        let mut live: Vec<(Vec<u32>, Vec<u32>)> = Vec::new(); // (table, tokens)
        let mut owner_tokens: HashMap<u32, Vec<u32>> = HashMap::new(); // block -> its tokens
        let mut rand = xorshift(0x9E37_79B9_u64);
        for _ in 0..4000 {
            if rand(2) == 0 || live.is_empty() {
                let n = 1 + rand(9) as usize;
                let tokens: Vec<u32> = (0..n).map(|_| rand(2) as u32).collect();
                let mut prefix = lookup_all(&bm, &tokens);
                prefix.truncate((n - 1) / bs); // at least one token is computed
                if !bm.can_allocate(n, &prefix, 0) {
                    continue;
                }
                for (j, &b) in prefix.iter().enumerate() {
                    assert_eq!(owner_tokens[&b], tokens[j * bs..(j + 1) * bs]);
                }
                let mut t = Vec::new();
                bm.allocate(&mut t, &prefix, n).unwrap();
                register_all(&mut bm, &t, &tokens);
                for (j, chunk) in tokens.chunks_exact(bs).enumerate().skip(prefix.len()) {
                    owner_tokens.insert(t[j], chunk.to_vec()); // a new (maybe evicted) block
                }
                live.push((t, tokens));
            } else {
                let i = rand(live.len() as u64) as usize;
                let (mut t, _) = live.swap_remove(i);
                bm.free(&mut t).unwrap();
            }
            bm.check_states().unwrap();
            // blocks whose contents were forgotten may be reused for other tokens
            owner_tokens.retain(|b, _| {
                live.iter().any(|(t, _)| t.contains(b)) || bm.content[*b as usize].is_some()
            });
        }
        for (mut t, _) in live.drain(..) {
            bm.free(&mut t).unwrap();
        }
        bm.check_no_leak().unwrap();
        assert!(bm.evictions > 0);
    }

    #[test]
    fn an_evicted_block_takes_its_state_checkpoint_with_it() {
        let mut bm = BlockManager::new(2, 2, true).with_states(StateCheckpoints::new(2, 4));
        let mut a = Vec::new();
        bm.allocate(&mut a, &[], 4).unwrap();
        let hashes = register_all(&mut bm, &a, &[5, 6, 7, 8]);
        let kept = bm.states.assign(hashes[0]).unwrap();
        bm.states.assign(hashes[1]).unwrap();
        bm.free(&mut a).unwrap(); // both evictable; block 1 released first, so evicted first
        let mut b = Vec::new();
        bm.allocate(&mut b, &[], 1).unwrap();
        assert_eq!(bm.evictions, 1);
        assert_eq!(
            bm.states.get(hashes[1]),
            None,
            "checkpoint of the evicted block"
        );
        assert_eq!(bm.states.get(hashes[0]), Some(kept));
        assert_eq!(bm.states.num_held(), 1);
        bm.free(&mut b).unwrap();
    }
}
