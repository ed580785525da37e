"""A draft round reads the device once and builds host metadata once, whatever k; its decode steps
advance their metadata on the device (spec_decode/draft_steps.py) and, on CUDA, replay the
draft's graphs without a host sync between them. Every run's proposals are checked against HF's
greedy continuation (draft == target, float32), so the counts are those of a correct round.
"""
from __future__ import annotations

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.spec_decode import draft_model
from pagedserve.spec_decode.draft_model import DraftModelProposer
from pagedserve.spec_decode.proposer import ProposalRequest
from spec_decode.host_reads import count_reads
from spec_decode.test_draft_model import PROMPTS, hf_greedy

SPEC_MODULES = ("pagedserve.spec_decode", "pagedserve.engine.speculation")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make(model_dir, device="cpu", **kw) -> DraftModelProposer:
    cfg = EngineConfig(model=str(model_dir), device=device, dtype="float32", block_size=kw.pop("block_size", 4),
                       max_num_seqs=8, cpu_kv_cache_gib=0.01, **kw)
    return DraftModelProposer(str(model_dir), cfg)


def greedy(seq_id, tokens, k):
    return ProposalRequest(seq_id, list(tokens), k, 0.0, None)


def rounds_with_full_acceptance(prop, hf, ks, rounds, check=None):
    """Propose `rounds` times for PROMPTS with per-request ks, each time accepting every proposal
    plus the target's bonus token (draft == target); every proposal must be HF's greedy token.
    check(round) runs around each propose() (a context manager factory) when given."""
    want = [hf_greedy(hf, p, rounds * (max(ks) + 1)) for p in PROMPTS]
    verified = [list(p) for p in PROMPTS]
    for r in range(rounds):
        reqs = [greedy(i, v, k) for i, (v, k) in enumerate(zip(verified, ks))]
        if check is None:
            got = prop.propose(reqs)
        else:
            with check(r):
                got = prop.propose(reqs)
        for i, v in enumerate(verified):
            done = len(v) - len(PROMPTS[i])
            assert got.token_ids[i] == want[i][done:done + ks[i]], (r, i)
            v.extend(want[i][done:done + ks[i] + 1])


@pytest.mark.parametrize("k", [1, 3, 6])
def test_one_device_read_and_one_metadata_build_per_round_whatever_k(model_dir, hf, monkeypatch, k):
    """Per round, with ks k, k - 1 and k (rows that stop early stay in the batch): the proposer's
    code reads tensor values on the host exactly once (draft_model.to_host: every draw of every
    step at once), and builds host metadata once (the catch-up's build_model_input); the k - 1
    decode steps build none. A read per step, or metadata rebuilt per step, would scale with k."""
    prop = make(model_dir)
    builds = []
    build = draft_model.build_model_input
    monkeypatch.setattr(draft_model, "build_model_input", lambda *a, **kw: builds.append(1) or build(*a, **kw))
    seen = []

    from contextlib import contextmanager

    @contextmanager
    def check(r):
        builds.clear()
        with count_reads(SPEC_MODULES) as reads:
            yield
        seen.append((dict(reads), len(builds)))

    rounds_with_full_acceptance(prop, hf, [k, max(1, k - 1), k], rounds=3, check=check)
    assert seen == [({("pagedserve.spec_decode.draft_model", "tolist"): 1}, 1)] * 3


def test_rows_that_stop_early_write_nothing_beyond_their_blocks(model_dir, hf):
    """block_size 1 and a pool of exactly the blocks the round reserves, so that every block belongs
    to some sequence: a row that has made its k proposals keeps stepping with the batch, and any
    KV it wrote would land in another sequence's block (or past its own table). Two more rounds
    read that KV back: their proposals still equal HF's greedy tokens."""
    ks = [1, 5, 2]
    need = sum(len(p) + k - 1 for p, k in zip(PROMPTS, ks)) + 2 * sum(k + 1 for k in ks)
    prop = DraftModelProposer(str(model_dir), EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                                           block_size=1, max_num_seqs=8), num_blocks=need)
    rounds_with_full_acceptance(prop, hf, ks, rounds=3)
    assert prop.kv.num_free_blocks() == 0  # every block in use: a stray write would have hit one


@cuda
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cuda_round_replays_graphs_without_a_host_sync(model_dir, hf, monkeypatch, temperature):
    """On CUDA a steady-state round (after a round that accepted everything: a 2-token catch-up per
    request) is the catch-up's replay as decode rows plus k - 1 replays of the draft's decode
    graph, with no host sync anywhere before the one read at the end
    (torch.cuda.set_sync_debug_mode("error") raises on any other: .item(), .tolist(), a pageable
    upload, nonzero...). Greedy proposals equal HF's; sampled rows (temperature 0.8, each with its
    own device generator) run the same way."""
    prop = make(model_dir, device="cuda", block_size=16)
    assert prop.graphs is not None
    replays, reads = [], []
    replay, read = prop.graphs.replay, draft_model.to_host
    monkeypatch.setattr(prop.graphs, "replay", lambda *a, **kw: replays.append(1) or replay(*a, **kw))

    def allowed_read(t):  # the round's one read: the only sync allowed
        reads.append(1)
        torch.cuda.set_sync_debug_mode(0)
        try:
            return read(t)
        finally:
            torch.cuda.set_sync_debug_mode("error")
    monkeypatch.setattr(draft_model, "to_host", allowed_read)
    k, ks = 4, [4, 2, 4]
    gens = [torch.Generator(device="cuda").manual_seed(i) for i in range(len(PROMPTS))]

    def propose(verified):
        return prop.propose([ProposalRequest(i, v, kk, temperature, gens[i])
                             for i, (v, kk) in enumerate(zip(verified, ks))])
    first = propose(PROMPTS)  # a prompt-long catch-up (eager); first use of every shape
    # Every proposal accepted, then a bonus token: HF's greedy one (greedy), any token (sampled).
    verified = []
    for p, toks in zip(PROMPTS, first.token_ids):
        v = list(p) + toks
        verified.append(v + [hf_greedy(hf, v, 1)[0] if temperature == 0.0 else 7])
    replays.clear()
    reads.clear()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = propose(verified)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(reads) == 1 and len(replays) == k  # catch-up (decode rows) + k - 1 decode steps
    assert [len(t) for t in got.token_ids] == ks
    if temperature == 0.0:
        assert first.token_ids == [hf_greedy(hf, p, kk) for p, kk in zip(PROMPTS, ks)]
        assert got.token_ids == [hf_greedy(hf, v, kk) for v, kk in zip(verified, ks)]
    else:
        assert got.draft_probs.shape == (sum(ks), 384)
        for row, tok in zip(got.draft_probs, [t for ids in got.token_ids for t in ids]):
            assert row[tok] > 0  # each proposal was drawn from its row


@pytest.mark.parametrize("k", [2, 5])
def test_engine_step_reads_the_device_twice_whatever_k(model_dir, hf, k):
    """In the engine, speculation's own code reads the device once per draft round (its proposals)
    and once per verification (accepted counts, final tokens and their logprobs together), for
    k = 2 and 5 alike; greedy output equals HF's greedy generate, token for token."""
    from pagedserve import SamplingParams
    from tests.engine.helpers import hf_greedy as hf_generate, make_llm

    llm = make_llm(model_dir, block_size=4, speculative_config={
        "method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k, "min_speculation_yield": 0})
    engine = llm.llm_engine
    rounds = []
    propose = engine.speculator.proposer.propose
    engine.speculator.proposer.propose = lambda reqs: (lambda p: rounds.append(any(p.token_ids)) or p)(propose(reqs))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with count_reads(SPEC_MODULES) as reads:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == hf_generate(model_dir, p, 12, ignore_eos=True)
    stats = engine.speculator.stats
    assert stats.num_spec_steps > 0 and stats.num_accepted_tokens > 0
    assert dict(reads) == {("pagedserve.spec_decode.draft_model", "tolist"): sum(rounds),
                           ("pagedserve.spec_decode.rejection", "tolist"): stats.num_spec_steps}
