"""Greedy output with draft-model speculation equals output without it (HF's greedy generate of the
target), token for token, across memory regimes (recompute, swap, chunked prefill, prefix caching)
and block sizes 1 and 16.

The draft is the target with its weights perturbed: it agrees with the target on most tokens but
not all, so every run both accepts and rejects proposals, and the draft's KV rollback is exercised.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from pagedserve import SamplingParams
from tests.engine.helpers import assert_no_leak, hf_greedy, make_llm, prompt_ids

K = 3


@pytest.fixture(scope="module")
def target_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def draft_dir(target_dir, tmp_path_factory):
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("perturbed-draft")
    for f in target_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    gen = torch.Generator().manual_seed(7)
    for f in target_dir.glob("*.safetensors"):
        tensors = load_file(f)
        noisy = {k: (v + 0.01 * torch.randn(v.shape, generator=gen)) if v.dim() >= 2 else v
                 for k, v in tensors.items()}
        save_file(noisy, out / f.name, metadata={"format": "pt"})
    return out


def spec(draft_dir, k=K, pausing=False):
    """The draft here is as large as the target, which the default policy never runs (it cannot
    pay: spec_decode/policy.py); the mechanism's tests ask for speculation as configured."""
    d = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": k}
    return d if pausing else dict(d, min_speculation_yield=0)


def run(llm, ids, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    assert_no_leak(llm)
    draft = llm.llm_engine.speculator.proposer
    assert draft.kv.num_free_blocks() == draft.kv.num_blocks and not draft.kv.seqs  # every draft block back
    return [o.outputs[0].token_ids for o in outs]


def check(target_dir, draft_dir, max_tokens=16, **kw):
    ids = prompt_ids(str(target_dir))[:4]
    llm = make_llm(target_dir, speculative_config=spec(draft_dir), **kw)
    got = run(llm, ids, max_tokens)
    for p, g in zip(ids, got):
        assert g == hf_greedy(target_dir, p, max_tokens, ignore_eos=True), p
    stats = llm.llm_engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats  # accepted and rejected proposals
    return llm


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_block_sizes(target_dir, draft_dir, block_size):
    check(target_dir, draft_dir, block_size=block_size)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(target_dir, draft_dir, mode):
    # 8-token blocks, 12 of them for 4 sequences: preemptions, after which the draft starts over.
    llm = check(target_dir, draft_dir, max_tokens=16, block_size=8, num_gpu_blocks_override=12,
                preemption_mode=mode, swap_space=0.05, max_num_batched_tokens=64)
    assert llm.get_kv_cache_stats().num_preemptions > 0


def test_chunked_prefill_and_prefix_caching(target_dir, draft_dir):
    # A 7-token budget: prompts chunk beside speculating decodes; a second round hits the prefix cache.
    llm = check(target_dir, draft_dir, block_size=4, max_num_batched_tokens=7, enable_prefix_caching=True)
    ids = prompt_ids(str(target_dir))[:4]
    assert run(llm, ids, 16) == [hf_greedy(target_dir, p, 16, ignore_eos=True) for p in ids]
    assert llm.get_kv_cache_stats().prefix_cache_hits > 0


def test_draft_equal_to_target_accepts_everything(target_dir):
    ids = prompt_ids(str(target_dir))[:3]
    llm = make_llm(target_dir, speculative_config=spec(target_dir, k=4), block_size=16)
    assert run(llm, ids, 16) == [hf_greedy(target_dir, p, 16, ignore_eos=True) for p in ids]
    stats = llm.llm_engine.speculator.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_seeded_sampling_reproducible(target_dir, draft_dir):
    """Sampled requests take the draft's probability rows through the rejection sampler; a seed
    makes the output the same run after run, whatever else is in the batch (with yield pausing
    off: the pause follows the whole batch's yield, so it would make the speculating steps, and
    with them the draws, depend on the batch)."""
    ids = prompt_ids(str(target_dir))[:3]
    seeded = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=11)
    other = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    outs = []
    for batch in ([ids[0]], ids):
        llm = make_llm(target_dir, speculative_config=spec(draft_dir), block_size=16)
        params = [seeded] + [other] * (len(batch) - 1)
        res = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        outs.append(res[0].outputs[0].token_ids)
        assert llm.llm_engine.speculator.stats.num_draft_tokens > 0
    assert outs[0] == outs[1] and len(outs[0]) == 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_cuda_draft_greedy_matches_hf(target_dir, draft_dir, enforce_eager):
    """On CUDA (float32): the draft's own CUDA graphs (unless enforce_eager) beside the target's."""
    ids = prompt_ids(str(target_dir))[:4]
    llm = make_llm(target_dir, device="cuda", enforce_eager=enforce_eager, max_num_seqs=16,
                   speculative_config=spec(draft_dir))
    assert (llm.llm_engine.speculator.proposer.graphs is None) == enforce_eager
    assert run(llm, ids, 16) == [hf_greedy(target_dir, p, 16, ignore_eos=True) for p in ids]
    stats = llm.llm_engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


def _block_bytes(model_dir, block_size: int) -> int:
    """float32 K and V of every layer for one block, from the HF config (not from the engine)."""
    from pagedserve.models.loader import load_hf_config

    c = load_hf_config(str(model_dir))
    return 2 * c.num_hidden_layers * block_size * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4


def test_pools_share_the_kv_budget(target_dir, tiny_model_dir, monkeypatch):
    """No num_gpu_blocks_override: the draft's weights load before the target's pool is sized,
    and the budget the target alone would have had (cpu_kv_cache_gib here) is split so that both
    pools have as many blocks; a one-layer draft has half the target's bytes per block, so the
    target gets 2/3 of the budget. Greedy output still equals HF's."""
    from pagedserve.engine import llm_engine
    from pagedserve.runner.model_runner import ModelRunner

    draft_dir = tiny_model_dir("llama", num_hidden_layers=1)
    order = []
    load_draft, sizing = llm_engine.load_draft_model, ModelRunner.determine_num_blocks
    monkeypatch.setattr(llm_engine, "load_draft_model", lambda *a: order.append("draft") or load_draft(*a))
    monkeypatch.setattr(ModelRunner, "determine_num_blocks", lambda self: order.append("size") or sizing(self))

    bs, tb, db = 16, _block_bytes(target_dir, 16), _block_bytes(draft_dir, 16)
    assert tb == 2 * db
    alone = 60  # target blocks the budget holds without a draft
    llm = make_llm(target_dir, speculative_config=spec(draft_dir), block_size=bs, num_gpu_blocks_override=None,
                   cpu_kv_cache_gib=alone * tb / (1 << 30))
    assert order == ["draft", "size"]
    engine = llm.llm_engine
    draft = engine.speculator.proposer
    n = alone * tb // (tb + db)
    assert (engine.cache_config.num_gpu_blocks, draft.kv.num_blocks) == (n, n) == (40, 40)
    assert (engine.runner.block_bytes, draft.block_bytes) == (tb, db)
    ids = prompt_ids(str(target_dir))[:4]
    assert run(llm, ids, 8) == [hf_greedy(target_dir, p, 8, ignore_eos=True) for p in ids]
    assert engine.speculator.stats.num_draft_tokens > 0


def test_no_room_beside_the_draft_names_the_fields(target_dir, draft_dir):
    """A budget of one target block: enough without a draft, none for a block of each."""
    with pytest.raises(ValueError, match="gpu_memory_utilization.*speculative_config.model"):
        make_llm(target_dir, speculative_config=spec(draft_dir), block_size=16, num_gpu_blocks_override=None,
                 cpu_kv_cache_gib=1.5 * _block_bytes(target_dir, 16) / (1 << 30))


# --- the catch-up within the step budget ---------------------------------------------------------
BUDGET = 32


@pytest.fixture
def draft_calls(monkeypatch):
    """Every draft forward's token count, and every round's catch-up pieces as (seq_id, start,
    tokens, proposes)."""
    from pagedserve.spec_decode.draft_model import DraftModelProposer

    forward, plan = DraftModelProposer._forward, DraftModelProposer._plan
    calls = {"forwards": [], "pieces": []}

    def recorded_forward(self, input_ids, *a, **kw):
        calls["forwards"].append(len(input_ids))
        return forward(self, input_ids, *a, **kw)

    def recorded_plan(self, requests):
        p = plan(self, requests)
        calls["pieces"] += [(requests[i].seq_id, s, q, i in p.ks) for i, s, q in p.pieces]
        return p

    monkeypatch.setattr(DraftModelProposer, "_forward", recorded_forward)
    monkeypatch.setattr(DraftModelProposer, "_plan", recorded_plan)
    return calls


def long_prompts(target_dir) -> list[list[int]]:
    ids = prompt_ids(str(target_dir))
    return [ids[1], ids[5], ids[8], ids[3]]  # 55, 90, 41 and 27 tokens


def check_within_budget(target_dir, draft_dir, calls, **kw) -> tuple:
    """Greedy with the draft equals greedy without speculation and HF's, no draft forward has
    more than BUDGET tokens, and some catch-up was longer (it went in pieces over rounds, each
    without a proposal, until the last piece: then the sequence proposes)."""
    ids, kw = long_prompts(target_dir), dict(block_size=8, max_num_batched_tokens=BUDGET,
                                             enable_chunked_prefill=True, **kw)
    # Pausing off: the catch-up's rounds are what is tested, and a catch-up round yields one token
    # per row (no proposal), which pauses speculation (spec_decode/policy.py) and so skips rounds.
    llm = make_llm(target_dir, speculative_config=spec(draft_dir), **kw)
    got = run(llm, ids, 16)
    off = make_llm(target_dir, **kw).generate([{"prompt_token_ids": p} for p in ids],
                                              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                                              use_tqdm=False)
    assert got == [o.outputs[0].token_ids for o in off] == [hf_greedy(target_dir, p, 16, ignore_eos=True) for p in ids]
    assert calls["forwards"] and max(calls["forwards"]) <= BUDGET, max(calls["forwards"])
    # Pieces that do not propose: a catch-up longer than the round's room (the first piece of each
    # such catch-up starts at 0: the prompt, or after a recompute the whole sequence again).
    long = [seq for seq, start, q, proposes in calls["pieces"] if not proposes and start == 0]
    assert long, calls["pieces"]
    for seq in set(long):  # each piece continues where the last one ended, until one proposes
        mine = [(start, q, p) for sq, start, q, p in calls["pieces"] if sq == seq]
        assert all(b[0] in (a[0] + a[1], 0) or a[2] for a, b in zip(mine, mine[1:])), mine
    stats = llm.llm_engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    return llm, long


def test_long_catch_up_runs_in_forwards_within_the_step_budget(target_dir, draft_dir, draft_calls):
    """Prompts longer than max_num_batched_tokens (chunked prefill): each one's catch-up after its
    prefill is longer than the budget, and the draft takes it over rounds of at most the budget."""
    check_within_budget(target_dir, draft_dir, draft_calls)


def test_long_catch_up_after_recompute_within_the_step_budget(target_dir, draft_dir, draft_calls):
    """20 blocks of 8 tokens for four sequences of up to 106 tokens: preemptions by recompute,
    after which the draft catches up on prompt and output again, more than the budget at once."""
    llm, long = check_within_budget(target_dir, draft_dir, draft_calls, num_gpu_blocks_override=20,
                                    preemption_mode="recompute")
    assert llm.get_kv_cache_stats().num_preemptions > 0
    assert len(long) > len(set(long)), long  # a sequence caught up on more than the budget twice


def test_the_default_policy_does_not_run_a_draft_as_large_as_the_target(target_dir, draft_dir):
    """Its proposals cost a target step each (weight bytes 1:1), so no step can pay: the engine
    decodes without speculating, overlapped, and the output is the target's."""
    ids = prompt_ids(str(target_dir))[:2]
    llm = make_llm(target_dir, speculative_config=spec(draft_dir, pausing=True), block_size=16)
    assert run(llm, ids, 8) == [hf_greedy(target_dir, p, 8, ignore_eos=True) for p in ids]
    sp = llm.llm_engine.speculator
    assert sp.policy.proposer_cost == pytest.approx(1.0)
    assert sp.stats.num_spec_steps == 0 and sp.stats.num_draft_tokens == 0
