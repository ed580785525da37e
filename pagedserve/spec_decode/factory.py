"""The proposer a SpeculativeConfig names. The draft-model proposer is imported lazily: it
pulls in a second model and its runner, which the n-gram path never needs."""
from __future__ import annotations

import importlib
from typing import Any

from pagedserve.spec_decode.config import SpeculativeConfig
from pagedserve.spec_decode.proposer import Proposer

DRAFT_MODULE = "pagedserve.spec_decode.draft_model"


def make_proposer(spec: SpeculativeConfig, engine: Any) -> Proposer:
    """engine: the LLMEngine the proposer serves (the draft model reads its config and device)."""
    if spec.method == "ngram":
        from pagedserve.spec_decode.ngram import NgramProposer
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    return _draft_module().DraftModelProposer(spec, engine)


def load_draft_model(spec: SpeculativeConfig, engine: Any) -> Proposer:
    """The draft-model proposer with its weights on the device and no KV pool yet: the engine
    builds it before sizing the target's pool, then calls its allocate_kv(num_blocks)."""
    return _draft_module().DraftModelProposer(spec, engine, defer_kv=True)


def _draft_module():
    try:
        return importlib.import_module(DRAFT_MODULE)
    except ModuleNotFoundError as e:
        if e.name != DRAFT_MODULE:
            raise
        raise ValueError("speculative_config.method draft_model is not available in this build "
                         f"({DRAFT_MODULE} is missing); use method ngram") from None
