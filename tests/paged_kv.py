"""Test helper: a tiny paged-KV block allocator that builds packed steps like the scheduler."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from eaglebatch.attention.base import AttentionMetadata


@dataclass
class PagedSequences:
    """Sequences and their blocks. Free blocks are handed out in shuffled order so block tables
    are non-contiguous, as they are after a while in a real run."""

    num_blocks: int
    block_size: int
    seed: int = 0
    free: list[int] = field(init=False)
    tables: dict[int, list[int]] = field(default_factory=dict)
    lengths: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.free = list(range(self.num_blocks))
        random.Random(self.seed).shuffle(self.free)

    def _ensure(self, seq: int, length: int) -> None:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.block_size < length:
            if not self.free:
                raise RuntimeError("out of KV blocks")
            table.append(self.free.pop())

    def truncate(self, seq: int, length: int) -> None:
        """Forget K/V past `length` (e.g. rejected speculative tokens); blocks are kept."""
        assert length <= self.lengths[seq]
        self.lengths[seq] = length

    def step(
        self, batch: list[tuple[int, list[int]]], device: str | torch.device = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Appends each (seq, new_tokens) and returns input_ids [T], positions [T], metadata."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        seq_lens = []
        for seq, tokens in batch:
            start = self.lengths.get(seq, 0)
            end = start + len(tokens)
            self._ensure(seq, end)
            table = self.tables[seq]
            for p in range(start, end):
                slots.append(table[p // self.block_size] * self.block_size + p % self.block_size)
            ids.extend(tokens)
            positions.extend(range(start, end))
            cu.append(cu[-1] + len(tokens))
            seq_lens.append(end)
            self.lengths[seq] = end
        width = max(len(self.tables[seq]) for seq, _ in batch)
        block_tables = np.zeros((len(batch), width), dtype=np.int32)
        for row, (seq, _) in enumerate(batch):
            block_tables[row, : len(self.tables[seq])] = self.tables[seq]
        meta = AttentionMetadata.from_numpy(
            np.array(cu), np.array(seq_lens), block_tables, np.array(slots), self.block_size, device
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        return input_ids, torch.tensor(positions, dtype=torch.long, device=device), meta
