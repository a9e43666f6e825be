"""The CSR page layout that paged-attention kernels (FlashInfer's wrappers) take, built from a
step's kv lengths and block tables. Pure numpy/torch: importable and testable without a GPU.

For B sequences with kv lengths k_i (context incl. this step's queries) and pages of `block_size`:
  n_i            = ceil(k_i / block_size)                  pages sequence i uses
  indptr         = [0, n_0, n_0 + n_1, ...]                int32 [B+1]  (CSR row pointer)
  indices        = block_tables[i, :n_i] for each i         int32 [indptr[B]] (page ids, row by row)
  last_page_len  = k_i - (n_i - 1) * block_size            int32 [B], in [1, block_size]
`indptr` and `last_page_len` are built on the host from host lengths. `indices` is gathered where
`block_tables` lives (the device) through `gather` (flat offsets i * M + j into block_tables), so
no device-to-host copy of the block tables is ever needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PagedLayout:
    indptr: torch.Tensor  # int32 [B+1], host
    last_page_len: torch.Tensor  # int32 [B], host
    gather: torch.Tensor  # int64 [indptr[B]], host: flat offsets into block_tables [B, M]

    @property
    def num_pages(self) -> int:
        return self.gather.shape[0]


def paged_layout(
    seq_lens: np.ndarray | torch.Tensor,  # [B] kv lengths, every one >= 1 (host)
    block_size: int,
    max_blocks: int,  # M, the width of the block tables the layout will index
) -> PagedLayout:
    lens = np.asarray(seq_lens.cpu() if isinstance(seq_lens, torch.Tensor) else seq_lens)
    lens = lens.astype(np.int64).reshape(-1)
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    if len(lens) == 0 or (lens <= 0).any():
        raise ValueError("every sequence needs a kv length >= 1")
    pages = -(-lens // block_size)  # [B] ceil
    if (pages > max_blocks).any():
        raise ValueError(
            f"a sequence needs {int(pages.max())} blocks but block tables hold {max_blocks}"
        )
    indptr = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(pages, out=indptr[1:])
    row = np.repeat(np.arange(len(lens), dtype=np.int64), pages)  # [nnz] sequence of each page
    col = np.arange(indptr[-1], dtype=np.int64) - np.repeat(indptr[:-1], pages)  # page in row
    return PagedLayout(
        indptr=torch.from_numpy(indptr.astype(np.int32)),
        last_page_len=torch.from_numpy((lens - (pages - 1) * block_size).astype(np.int32)),
        gather=torch.from_numpy(row * max_blocks + col),
    )


def gather_page_indices(
    block_tables: torch.Tensor,  # int32 [B, M], any device
    gather: torch.Tensor,  # int64 [nnz] flat offsets from paged_layout (host or same device)
) -> torch.Tensor:  # int32 [nnz] on block_tables' device
    """`indices` of the layout: an asynchronous gather on block_tables' device (no host sync)."""
    gather = gather.to(block_tables.device, non_blocking=True)
    return block_tables.reshape(-1).index_select(0, gather).to(torch.int32)
