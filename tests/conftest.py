import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from support.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def drafts(tiny_model_dir, tmp_path_factory):
    """Random draft heads of both formats over the tiny model."""
    from eaglebatch.speculative import init_random_draft

    root = tmp_path_factory.mktemp("drafts")
    return {
        "eagle1": init_random_draft(root / "e1", tiny_model_dir, kind="eagle1", seed=1),
        "eagle3": init_random_draft(
            root / "e3", tiny_model_dir, kind="eagle3", draft_vocab_size=200, seed=2,
            aux_layer_ids=(0, 1, 2),
        ),
    }
