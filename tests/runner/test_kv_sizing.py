"""The start-up profile (runner/kv_sizing.py) runs the largest step the scheduler can build, and
no larger: with few sequences and a large token budget, no profiled sequence is longer than
max_model_len. A longer one indexed past OPT's learned position table (a device-side assert on
the H200 with max_num_seqs=16 and the default 16,384-token budget; an IndexError on the CPU)."""
from pagedserve.runner.model_runner import PROFILE_ON_CPU_ENV

from tests.engine.helpers import make_llm


def test_profile_keeps_every_sequence_within_max_model_len(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(PROFILE_ON_CPU_ENV, "1")
    # 2 sequences x 512 tokens at most, against a 4,096-token budget; OPT's table has 512 + 2 rows.
    llm = make_llm(tiny_model_dir("opt"), max_num_seqs=2, max_num_batched_tokens=4096, max_model_len=512)
    try:
        profile = llm.llm_engine.runner.profile
        assert profile["recompute_seconds_per_token"] > 0
    finally:
        llm.shutdown()
