import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from support.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
