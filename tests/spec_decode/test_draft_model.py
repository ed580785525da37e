"""DraftModelProposer against plain references: HF transformers' own forward of the same weights.

One tiny Llama serves as draft and target (draft == target: its greedy proposals are the target's
greedy tokens). Every check compares token ids or probabilities with HF's, never with constants.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.spec_decode.catch_up import plan_catch_up
from pagedserve.spec_decode.draft_model import DraftModelProposer
from pagedserve.spec_decode.proposer import ProposalRequest

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11], [60, 61, 62], [300, 4, 8, 15, 16, 23, 42, 108, 77, 31, 9, 200, 201]]


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """HF's next-token logits after `tokens` (a full, non-paged forward)."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1].float()


def hf_greedy(hf, tokens: list[int], n: int) -> list[int]:
    out = list(tokens)
    for _ in range(n):
        out.append(int(hf_logits(hf, out).argmax()))
    return out[len(tokens):]


def make(model_dir, block_size=16, **kw) -> DraftModelProposer:
    cfg = EngineConfig(model=str(model_dir), device="cpu", block_size=block_size, max_num_seqs=8,
                       cpu_kv_cache_gib=0.01)
    return DraftModelProposer(str(model_dir), cfg, **kw)


def greedy(seq_id, tokens, k):
    return ProposalRequest(seq_id=seq_id, token_ids=list(tokens), num_speculative_tokens=k, temperature=0.0,
                           generator=None)


@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_proposals_equal_hf_continuation(model_dir, hf, block_size):
    prop = make(model_dir, block_size)
    ks = [4, 2, 3]
    got = prop.propose([greedy(i, p, k) for i, (p, k) in enumerate(zip(PROMPTS, ks))])
    assert got.draft_probs is None  # all greedy: a deterministic proposer
    assert got.token_ids == [hf_greedy(hf, p, k) for p, k in zip(PROMPTS, ks)]


def test_draft_equals_target_full_acceptance_rounds(model_dir, hf):
    """The speculative loop with draft == target: every proposal is the target's greedy token, so
    the target accepts all k and adds its bonus token; each round catches the draft up on 2 tokens."""
    prop = make(model_dir)
    k, rounds = 3, 4
    target = [hf_greedy(hf, p, rounds * (k + 1)) for p in PROMPTS[:2]]
    verified = [list(p) for p in PROMPTS[:2]]
    for _ in range(rounds):
        got = prop.propose([greedy(i, v, k) for i, v in enumerate(verified)])
        for i, v in enumerate(verified):
            done = len(v) - len(PROMPTS[i])
            assert got.token_ids[i] == target[i][done:done + k]
            v.extend(target[i][done:done + k + 1])  # all accepted, plus the bonus token


@pytest.mark.parametrize("accepted", [0, 1, 3])
def test_catch_up_after_partial_acceptance_equals_fresh_draft(model_dir, accepted):
    """After the target accepts `accepted` of k=4 proposals and corrects the next, the proposer's
    next round (its stale KV rolled back) proposes what a fresh proposer proposes on that prefix."""
    prop = make(model_dir, block_size=4)
    prompt = PROMPTS[0]
    first = prop.propose([greedy(7, prompt, 4)]).token_ids[0]
    correction = (first[accepted] + 1) % 300 if accepted < 4 else None
    verified = prompt + first[:accepted] + ([correction] if correction is not None else [])
    again = prop.propose([greedy(7, verified, 4)])
    fresh = make(model_dir, block_size=4).propose([greedy(7, verified, 4)])
    assert again.token_ids == fresh.token_ids
    st = prop.kv.seqs[7]
    assert (st.num_verified, st.speculative) == (len(verified), again.token_ids[0][:-1])


@pytest.mark.parametrize("kept", [0, 2])
def test_rollback_when_rounds_were_skipped(model_dir, kept):
    """The sequence grew by several verified tokens without a round in between (speculation was
    off for it): only the first `kept` of the draft's KV'd proposals are still valid."""
    prop = make(model_dir, block_size=2)
    prompt = PROMPTS[2]
    first = prop.propose([greedy(3, prompt, 4)]).token_ids[0]
    verified = prompt + first[:kept] + [(first[kept] + 1) % 300, 5, 6, 7]
    assert prop.kv.match(3, verified) == len(prompt) + kept
    again = prop.propose([greedy(3, verified, 3)])
    assert again.token_ids == make(model_dir, block_size=2).propose([greedy(3, verified, 3)]).token_ids


def test_finish_frees_every_block(model_dir):
    prop = make(model_dir, block_size=2)
    total = prop.kv.num_free_blocks()
    prop.propose([greedy(i, p, 4) for i, p in enumerate(PROMPTS)])
    assert prop.kv.num_free_blocks() < total
    for i in range(len(PROMPTS)):
        prop.finish(i)
    prop.finish(12345)  # never seen: nothing to do
    assert prop.kv.num_free_blocks() == total and not prop.kv.seqs


def test_short_pool_lowers_k_instead_of_failing(model_dir, hf):
    """With 3 blocks of 4 tokens (12 slots), an 8-token prompt has room for KV of 8 + (k-1) <= 12
    tokens: k=6 is lowered to 5; a second 8-token sequence finds one block and gets nothing."""
    prop = make(model_dir, block_size=4, num_blocks=3)
    got = prop.propose([greedy(0, PROMPTS[0], 6), greedy(1, PROMPTS[0], 2)])
    assert got.token_ids == [hf_greedy(hf, PROMPTS[0], 5), []]


def test_seeded_sampling_is_reproducible_and_probs_are_the_drafts(model_dir, hf):
    temp = 0.7

    def run():
        prop = make(model_dir)
        gen = torch.Generator().manual_seed(1234)
        reqs = [ProposalRequest(0, PROMPTS[0], 4, temp, gen), greedy(1, PROMPTS[1], 2)]
        return prop.propose(reqs)

    a, b = run(), run()
    assert a.token_ids == b.token_ids
    assert torch.equal(a.draft_probs, b.draft_probs)
    assert a.draft_probs.shape == (6, 384)
    # Row j of request 0 is softmax(logits / T) of HF after the prompt and proposals 1..j-1.
    for j in range(4):
        ref = torch.softmax(hf_logits(hf, PROMPTS[0] + a.token_ids[0][:j]) / temp, dim=-1)
        torch.testing.assert_close(a.draft_probs[j], ref, atol=1e-4, rtol=1e-3)
    # The greedy request's rows are one-hot at its (HF greedy) proposals.
    assert a.token_ids[1] == hf_greedy(hf, PROMPTS[1], 2)
    assert torch.equal(a.draft_probs[4:].argmax(-1), torch.tensor(a.token_ids[1]))
    assert torch.equal(a.draft_probs[4:].sum(-1), torch.ones(2))


def test_refuses_a_draft_with_another_vocabulary(model_dir, tiny_model_dir, tmp_path):
    other = tiny_model_dir("llama", vocab_size=400)
    cfg = EngineConfig(model=str(model_dir), device="cpu")
    with pytest.raises(ValueError, match=r"vocab_size \(400\) differs from the target's \(384\)"):
        DraftModelProposer(str(other), cfg)
    # Same size, another token -> id map: refused by its tokenizer.json.
    swapped = tmp_path / "swapped"
    shutil.copytree(model_dir, swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[10], list(vocab)[11]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="tokenizer"):
        DraftModelProposer(str(swapped), cfg)


@pytest.mark.parametrize("budget", [1, 3, 8, 24, 100])
def test_plan_catch_up_against_its_definition(budget):
    """At most budget tokens a round; shortest catch-ups first; a request proposes only when its
    whole catch-up is in; one that does not fit gets the room left as a piece (none when nothing
    is left); requests without blocks are skipped; every request is caught up after enough rounds,
    each round's pieces continuing where the last ended."""
    unseen = [(0, 8), (2, 1), None, (5, 8), (0, 1), (1, 39), (1, 1)]
    no_blocks = {6}
    seen = {i: u[0] for i, u in enumerate(unseen) if u is not None}
    ends = {i: u[0] + u[1] for i, u in enumerate(unseen) if u is not None}
    proposed, rounds = set(), 0
    while len(proposed) < len(ends) - len(no_blocks):
        left = [None if u is None or i in proposed else (seen[i], ends[i] - seen[i]) for i, u in enumerate(unseen)]
        plan = plan_catch_up(left, budget, lambda i, tokens: -1 if i in no_blocks else (3 if tokens == ends[i] else 0))
        assert sum(q for _, _, q in plan.pieces) <= budget
        assert plan.pieces == sorted(plan.pieces) and plan.active == sorted(plan.active)
        for i, s, q in plan.pieces:
            assert s == seen[i] and q > 0 and i not in no_blocks
            seen[i] += q
            assert (i in plan.ks) == (seen[i] == ends[i])
        # Shortest first: a request left out or cut while a longer one got in is impossible.
        got = {i for i, _, _ in plan.pieces}
        for i, u in enumerate(left):
            if u is not None and i not in no_blocks and i not in plan.ks:
                assert all(left[j][1] <= u[1] for j in plan.ks), (i, plan)
        assert len(got - set(plan.ks)) <= 1  # at most one piece that does not propose
        proposed |= set(plan.ks)
        rounds += 1
        assert rounds <= 60
    total = sum(u[1] for i, u in enumerate(unseen) if u is not None and i not in no_blocks)
    assert (rounds == 1) == (total <= budget)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("budget", [5, 24])
def test_catch_up_over_rounds_proposes_hf_greedy(model_dir, hf, monkeypatch, budget, device):
    """max_num_batched_tokens 5: the 24-token catch-up of three prompts (8, 3 and 13 tokens) runs
    over rounds of one forward of at most 5 tokens, the short prompt proposing in the first and
    each longer one in the round its last piece goes in; the proposals are HF's greedy
    continuation. With 24 it is one round. On CUDA (float32) the draft's steps replay its graphs."""
    sizes = []
    forward = DraftModelProposer._forward
    monkeypatch.setattr(DraftModelProposer, "_forward",
                        lambda self, ids, *a, **kw: sizes.append(len(ids)) or forward(self, ids, *a, **kw))
    cfg = EngineConfig(model=str(model_dir), device=device, dtype="float32", block_size=4, max_num_seqs=8,
                       cpu_kv_cache_gib=0.01, max_num_batched_tokens=budget)
    prop = DraftModelProposer(str(model_dir), cfg)
    assert (prop.graphs is not None) == (device == "cuda")
    ks = [4, 2, 3]
    want = [hf_greedy(hf, p, k) for p, k in zip(PROMPTS, ks)]
    got, rounds = [None] * 3, 0  # the round each request first proposes in
    while None in got:
        sizes.clear()
        out = prop.propose([greedy(i, p, k) for i, (p, k) in enumerate(zip(PROMPTS, ks))])
        rounds += 1
        assert sizes[0] <= budget
        for i, toks in enumerate(out.token_ids):
            if toks:  # a caught-up request proposes again each round: the same tokens
                assert toks == want[i], (rounds, i)
                got[i] = rounds if got[i] is None else got[i]
        assert rounds <= 12
    # The 3-token prompt fits the first round; the others need rounds of their own when split.
    if budget == 24:
        assert got == [1, 1, 1]
    else:
        assert got[1] == 1 and min(got[0], got[2]) > 1, got


@pytest.mark.parametrize("field", ["hidden_size", "intermediate_size", "num_attention_heads"])
def test_refuses_a_draft_wider_than_the_target(model_dir, tiny_model_dir, field):
    """A draft with a larger hidden_size, MLP or attention width than the target's could need more
    activation memory at the step budget than the start-up profile measured (the module docstring)."""
    wider = {"hidden_size": dict(hidden_size=128, num_attention_heads=8),  # head_dim 16 either way
             "intermediate_size": dict(intermediate_size=256),
             "num_attention_heads": dict(num_attention_heads=4, head_dim=32)}[field]
    other = tiny_model_dir("llama", **wider)
    cfg = EngineConfig(model=str(model_dir), device="cpu")
    with pytest.raises(ValueError, match=f"speculative_config.model: the draft model's {field}.* is larger"):
        DraftModelProposer(str(other), cfg)
    # Narrower (one layer fewer does not matter) is fine.
    DraftModelProposer(str(tiny_model_dir("llama", intermediate_size=64)), cfg)


def test_factory_builds_it_from_the_engine(model_dir, hf):
    """make_proposer(spec, engine) -> DraftModelProposer(spec, engine): the draft is spec.model and
    the pool matches the engine's token capacity (its KV pool's blocks x block size)."""
    from types import SimpleNamespace

    from pagedserve.core.config import CacheConfig
    from pagedserve.models.loader import load_hf_config
    from pagedserve.spec_decode.config import SpeculativeConfig
    from pagedserve.spec_decode.factory import make_proposer

    cfg = EngineConfig(model=str(model_dir), device="cpu", block_size=4)
    engine = SimpleNamespace(config=cfg, device=torch.device("cpu"), hf_config=load_hf_config(model_dir),
                             max_model_len=256, cache_config=CacheConfig(block_size=4, num_gpu_blocks=10))
    spec = SpeculativeConfig.from_json({"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 2})
    prop = make_proposer(spec, engine)
    assert isinstance(prop, DraftModelProposer)
    assert (prop.kv.num_blocks, prop.max_model_len) == (10, 256)
    assert prop.propose([greedy(0, PROMPTS[1], 2)]).token_ids == [hf_greedy(hf, PROMPTS[1], 2)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("eager", [True, False])
def test_cuda_graphs_and_eager_propose_hf_greedy(model_dir, hf, eager):
    """On CUDA the draft's decode steps replay its CUDA graphs (and short catch-ups run as decode
    rows); float32, so its greedy tokens must equal HF's on the CPU."""
    cfg = EngineConfig(model=str(model_dir), device="cuda", dtype="float32", block_size=16, max_num_seqs=8,
                       enforce_eager=eager)
    prop = DraftModelProposer(str(model_dir), cfg)
    assert (prop.graphs is None) == eager
    k, verified = 3, [list(p) for p in PROMPTS]
    target = [hf_greedy(hf, p, 3 * (k + 1)) for p in PROMPTS]
    for _ in range(3):
        got = prop.propose([greedy(i, v, k) for i, v in enumerate(verified)])
        for i, v in enumerate(verified):
            done = len(v) - len(PROMPTS[i])
            assert got.token_ids[i] == target[i][done:done + k]
            v.extend(target[i][done:done + k + 1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_sizes_both_pools_within_the_budget(model_dir, hf):
    """On CUDA, no block override: the draft's weights load before the profile, whose KV budget
    (gpu_memory_utilization after both models' weights) is split so that both pools have as many
    blocks and together fit it; greedy output equals HF's. gpu_memory_utilization leaves about
    1 GiB above what the device holds now (at 0.9 a tiny model would get millions of blocks)."""
    from pagedserve import LLM, SamplingParams

    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    util = min(0.9, (total - free + (1 << 30)) / total)
    llm = LLM(str(model_dir), device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=512,
              swap_space=0.01, enforce_eager=True, gpu_memory_utilization=util,
              # min_speculation_yield 0: the default policy never runs a draft as large as the target.
              speculative_config={"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3,
                                  "min_speculation_yield": 0})
    try:
        engine = llm.llm_engine
        draft = engine.speculator.proposer
        n, tb, db = engine.cache_config.num_gpu_blocks, engine.runner.block_bytes, draft.block_bytes
        budget = engine.runner.profile["kv_budget_bytes"]
        assert draft.kv.num_blocks == n >= 1
        assert n * (tb + db) <= budget < (n + 1) * (tb + db) + tb  # the split of floor(budget / tb) target blocks
        assert torch.cuda.memory_allocated(engine.device) <= engine.config.gpu_memory_utilization * total
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 8) for p in PROMPTS]
        assert engine.speculator.stats.num_draft_tokens > 0
    finally:
        llm.shutdown()
