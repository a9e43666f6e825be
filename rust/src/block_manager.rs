//! Paged KV-cache block manager (vLLM's "BlockSpaceManager" without prefix caching).
//!
//! The KV cache is `num_blocks` blocks of `block_size` token slots. A sequence owns a block
//! table (a list of block ids, stored on the `Sequence`); token position `p` of the sequence
//! lives in KV slot `table[p / block_size] * block_size + p % block_size`.
//!
//! Invariants:
//! - every block id in `[0, num_blocks)` is either in the free list or owned by exactly one
//!   block table (`owned[b]` says which), never both and never twice;
//! - a block table of a sequence holding `n` tokens has exactly `ceil(n / block_size)` blocks.

use std::collections::VecDeque;

use crate::error::{Error, Result};

#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    num_blocks: usize,
    /// Free block ids. Allocation pops from the front, freeing pushes to the back (so recently
    /// freed blocks are reused last, which makes use-after-free bugs in a worker visible sooner).
    free: VecDeque<u32>,
    /// `owned[b]` is true while block `b` belongs to some block table.
    owned: Vec<bool>,
}

impl BlockManager {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        BlockManager {
            block_size,
            num_blocks,
            free: (0..num_blocks as u32).collect(),
            owned: vec![false; num_blocks],
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn num_free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Blocks needed to hold `num_tokens` tokens.
    pub fn blocks_needed(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// Whether a fresh sequence of `num_tokens` tokens fits while keeping `reserve` blocks free.
    pub fn can_allocate(&self, num_tokens: usize, reserve: usize) -> bool {
        self.blocks_needed(num_tokens) + reserve <= self.free.len()
    }

    /// Extra blocks a table needs so that it can hold `num_tokens` tokens.
    pub fn blocks_to_grow(&self, table: &[u32], num_tokens: usize) -> usize {
        self.blocks_needed(num_tokens).saturating_sub(table.len())
    }

    /// Gives an empty table the blocks for `num_tokens` tokens.
    pub fn allocate(&mut self, table: &mut Vec<u32>, num_tokens: usize) -> Result<()> {
        if !table.is_empty() {
            return Err(Error::internal(
                "allocate() on a sequence that already holds blocks",
            ));
        }
        self.grow(table, num_tokens)
    }

    /// Appends blocks to `table` until it can hold `num_tokens` tokens (a decode step needs at
    /// most one more block per new token block crossed).
    pub fn grow(&mut self, table: &mut Vec<u32>, num_tokens: usize) -> Result<()> {
        let need = self.blocks_to_grow(table, num_tokens);
        if need > self.free.len() {
            return Err(Error::internal(format!(
                "out of KV blocks: need {need}, {} free",
                self.free.len()
            )));
        }
        for _ in 0..need {
            let block = self.free.pop_front().expect("checked above");
            let owned = &mut self.owned[block as usize];
            debug_assert!(!*owned, "block {block} handed out twice");
            *owned = true;
            table.push(block);
        }
        Ok(())
    }

    /// Returns all blocks of `table` to the free list and empties it.
    pub fn free(&mut self, table: &mut Vec<u32>) -> Result<()> {
        for &block in table.iter() {
            let owned = self.owned.get_mut(block as usize).ok_or_else(|| {
                Error::internal(format!("free of block {block} outside [0, num_blocks)"))
            })?;
            if !*owned {
                return Err(Error::internal(format!("double free of KV block {block}")));
            }
            *owned = false;
            self.free.push_back(block);
        }
        table.clear();
        Ok(())
    }

    /// KV slot index of token position `pos` of a sequence with block table `table`.
    pub fn slot(&self, table: &[u32], pos: usize) -> i64 {
        let block = table[pos / self.block_size] as i64;
        block * self.block_size as i64 + (pos % self.block_size) as i64
    }

    /// Checks that every block is back in the free list (nothing owned, nothing lost).
    pub fn check_no_leak(&self) -> Result<()> {
        let owned = self.owned.iter().filter(|&&o| o).count();
        if owned != 0 || self.free.len() != self.num_blocks {
            return Err(Error::internal(format!(
                "KV block leak: {owned} blocks still owned, {} of {} free",
                self.free.len(),
                self.num_blocks
            )));
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
        let bm = BlockManager::new(8, 4);
        assert_eq!(bm.blocks_needed(0), 0);
        assert_eq!(bm.blocks_needed(1), 1);
        assert_eq!(bm.blocks_needed(4), 1);
        assert_eq!(bm.blocks_needed(5), 2);
    }

    #[test]
    fn allocate_grow_free_no_leak() {
        let mut bm = BlockManager::new(8, 4);
        let mut a = Vec::new();
        let mut b = Vec::new();
        bm.allocate(&mut a, 5).unwrap();
        assert_eq!(a.len(), 2);
        bm.allocate(&mut b, 4).unwrap();
        assert_eq!(bm.num_free_blocks(), 5);
        // Growing within the last block takes nothing; crossing a boundary takes one block.
        bm.grow(&mut b, 4).unwrap();
        assert_eq!(b.len(), 1);
        bm.grow(&mut b, 5).unwrap();
        assert_eq!(b.len(), 2);
        assert_eq!(bm.num_free_blocks(), 4);
        assert!(bm.can_allocate(16, 0));
        assert!(!bm.can_allocate(17, 0));
        assert!(!bm.can_allocate(16, 1));
        bm.free(&mut a).unwrap();
        bm.free(&mut b).unwrap();
        assert!(a.is_empty() && b.is_empty());
        bm.check_no_leak().unwrap();
    }

    #[test]
    fn out_of_blocks_is_an_error_not_a_panic() {
        let mut bm = BlockManager::new(2, 4);
        let mut a = Vec::new();
        assert!(bm.allocate(&mut a, 9).is_err());
        assert!(a.is_empty());
        bm.check_no_leak().unwrap();
    }

    #[test]
    fn double_free_detected() {
        let mut bm = BlockManager::new(2, 4);
        let mut a = Vec::new();
        bm.allocate(&mut a, 3).unwrap();
        let mut copy = a.clone();
        bm.free(&mut a).unwrap();
        assert!(bm.free(&mut copy).is_err());
    }

    #[test]
    fn slot_mapping() {
        let mut bm = BlockManager::new(4, 4);
        let mut burn = Vec::new();
        bm.allocate(&mut burn, 4).unwrap(); // takes block 0
        let mut t = Vec::new();
        bm.allocate(&mut t, 6).unwrap(); // blocks 1, 2
        assert_eq!(t, vec![1, 2]);
        assert_eq!(bm.slot(&t, 0), 4);
        assert_eq!(bm.slot(&t, 3), 7);
        assert_eq!(bm.slot(&t, 4), 8);
        assert_eq!(bm.slot(&t, 5), 9);
    }

    /// Random alloc/grow/free cycles: a block is never in two live tables, and after freeing
    /// everything all blocks are free again.
    #[test]
    fn randomized_cycles_never_hand_out_a_block_twice() {
        let mut bm = BlockManager::new(32, 3);
        let mut tables: Vec<(Vec<u32>, usize)> = Vec::new();
        let mut state = 0x1234_5678_u64;
        let mut rand = move |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        for _ in 0..5000 {
            match rand(3) {
                0 => {
                    let n = 1 + rand(20) as usize;
                    if bm.can_allocate(n, 0) {
                        let mut t = Vec::new();
                        bm.allocate(&mut t, n).unwrap();
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
}
