"""EAGLE speculative decoding: draft heads (EAGLE-1/2, EAGLE-3), verification, the SpecWorker.

Only chain drafting (topk == 1) is implemented: each round drafts k <= K tokens by argmax,
verifies them with one target forward and emits the accepted prefix plus one target token.
"""

from eaglebatch.speculative.adaptive import (
    AdaptiveDraftLength,
    chain_expected_tokens,
    expected_tokens,
)
from eaglebatch.speculative.checkpoint import init_random_draft, read_draft_tensors
from eaglebatch.speculative.draft_config import DraftConfig, default_aux_layer_ids
from eaglebatch.speculative.eagle import EagleDraft, load_draft
from eaglebatch.speculative.verify import verify, verify_greedy, verify_sampling
from eaglebatch.speculative.worker import TREE_UNSUPPORTED, SpecStats, SpecWorker

__all__ = [
    "TREE_UNSUPPORTED",
    "AdaptiveDraftLength",
    "DraftConfig",
    "EagleDraft",
    "SpecStats",
    "SpecWorker",
    "default_aux_layer_ids",
    "chain_expected_tokens",
    "expected_tokens",
    "init_random_draft",
    "load_draft",
    "read_draft_tensors",
    "verify",
    "verify_greedy",
    "verify_sampling",
]
