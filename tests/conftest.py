import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A factory: tiny_model_dir(arch) -> path of a saved tiny HF model (cached per session)."""
    from tiny_models import make_tiny_model
    cache = {}

    def get(arch: str = "llama", **overrides):
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), **overrides)
        return cache[key]
    return get
