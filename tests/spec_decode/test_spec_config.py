"""SpeculativeConfig parses vLLM's --speculative-config JSON and refuses what it cannot honour;
the adaptive policy's k for a batch."""
import argparse

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine_args import add_engine_args, engine_config_from_args
from pagedserve.spec_decode.config import SpeculativeConfig
from pagedserve.spec_decode.policy import SpeculationPolicy


def test_ngram_defaults_and_cli_json():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
                                                 '"prompt_lookup_max": 4}'])
    cfg = engine_config_from_args(args, None).speculative_config
    assert cfg["prompt_lookup_min"] == 4 and cfg["prompt_lookup_max"] == 4 and cfg["num_speculative_tokens"] == 3
    assert SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 1}).prompt_lookup_max == 5


@pytest.mark.parametrize("bad,field", [
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "draft_tensor_parallel_size"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
    ("{not json", "JSON"),
])
def test_refusals_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model=None, speculative_config=bad)


def test_policy_lowers_k_then_turns_off():
    p = SpeculationPolicy(4, 256)
    assert [p.tokens_to_propose(d) for d in (0, 1, 51, 52, 64, 85, 128, 129)] == [0, 4, 4, 3, 3, 2, 1, 0]
    assert SpeculationPolicy(4, 256, disable_by_batch_size=8).tokens_to_propose(8) == 0
