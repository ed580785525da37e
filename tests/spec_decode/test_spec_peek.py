"""Peeking before going synchronous (spec_decode/proposer.py, LLMEngine.step): a host-side proposer
is asked over the host's histories before a step gives up its overlap. With async scheduling, an
n-gram over greedy output that never repeats keeps every step overlapped (nothing paused, nothing
empty); a proposer that has nothing keeps every step overlapped too, while one whose peek finds
something and whose fresh proposal then finds nothing is counted empty and paused as before;
copy-heavy prompts still speculate and accept; greedy output equals decoding without speculation
throughout. The policy's state for a step its proposer had nothing for is exact: neither paused
nor empty, a due probe stays due."""
import numpy as np
import pytest

from pagedserve import SamplingParams
from pagedserve.spec_decode.ngram import ngram_propose
from pagedserve.spec_decode.policy import EMPTY_STEPS_BEFORE_PAUSE, SpeculationPolicy
from pagedserve.spec_decode.proposer import Proposals
from engine.helpers import PROMPT_TEXTS, assert_no_leak, make_llm, tokenizer
from spec_decode.spec_helpers import NGRAM_PAUSING, TEXTS

T = 1.25
MAX_TOKENS = 24
# The tiny Llama's greedy output after these prompts repeats no 3-gram of its history for its
# first NOREPEAT_TOKENS tokens (the test checks it on the reference).
NOREPEAT_PROMPTS = [PROMPT_TEXTS[i] for i in (0, 3, 4, 5, 8)]
NOREPEAT_TOKENS = 9
NGRAM_3 = {**NGRAM_PAUSING, "prompt_lookup_min": 3, "prompt_lookup_max": 3}


def test_a_step_with_nothing_to_propose_is_neither_paused_nor_empty():
    p = SpeculationPolicy(4, 256, min_speculation_yield=T)
    assert p.tokens_to_propose(1) == 1  # the first step probes
    for _ in range(50):  # the proposer had nothing: the probe stays due, nothing counts
        p.nothing_to_propose()
        assert p.tokens_to_propose(1) == 1
    assert (p.num_paused_steps, p.empty_streak, p.pause_left, p.step_k) == (0, 0, 0, 1)
    # Such steps neither extend nor end a streak of empty speculating steps.
    for _ in range(EMPTY_STEPS_BEFORE_PAUSE - 1):
        p.observe_empty()
        p.nothing_to_propose()
        p.tokens_to_propose(1)
    assert p.empty_streak == EMPTY_STEPS_BEFORE_PAUSE - 1 and p.pause_left == 0
    p.observe_empty()
    assert p.pause_left == 8 and p.probing
    p.nothing_to_propose()
    assert p.step_k == 0


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    """The tiny Llama, and greedy references without speculation: TEXTS[:3] (copy-heavy and plain)
    and the prompts whose output does not repeat."""
    model_dir = tiny_model_dir("llama")
    tok = tokenizer(str(model_dir))
    base = make_llm(model_dir, block_size=4)
    refs = {}
    for name, texts, n in (("texts", TEXTS[:3], MAX_TOKENS), ("norepeat", NOREPEAT_PROMPTS, NOREPEAT_TOKENS)):
        ids = [tok.encode(t) for t in texts]
        refs[name] = ids, _greedy(base, ids, n)
    return model_dir, refs


def _greedy(llm, ids, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    assert_no_leak(llm)
    return [o.outputs[0].token_ids for o in outs]


def _counting(llm, monkeypatch):
    """{"overlapped": steps launched overlapped, "sync": steps run synchronously}."""
    engine, counts = llm.llm_engine, {"overlapped": 0, "sync": 0}
    launch, run_sync = engine._launch, engine._run_sync

    def counted(name, fn):
        def call(*a):
            counts[name] += 1
            return fn(*a)
        return call
    monkeypatch.setattr(engine, "_launch", counted("overlapped", launch))
    monkeypatch.setattr(engine, "_run_sync", counted("sync", run_sync))
    return counts


def test_ngram_over_output_that_does_not_repeat_keeps_every_step_overlapped(setup, monkeypatch):
    model_dir, refs = setup
    ids, want = refs["norepeat"]
    for p, w in zip(ids, want):  # the premise: no history the proposer sees has a match
        t = np.asarray(p + w, dtype=np.int64)
        assert not any(ngram_propose(t[:n], 3, 3, 4).size for n in range(len(p), len(t)))
    llm = make_llm(model_dir, block_size=4, speculative_config=NGRAM_3)
    assert llm.llm_engine.async_scheduling
    counts = _counting(llm, monkeypatch)
    assert _greedy(llm, ids, NOREPEAT_TOKENS) == want
    st = llm.get_spec_decode_stats()
    # 8 decode steps, every one peeked, found nothing and launched overlapped, as did the prompts'
    # step; the call that collects the last step's tokens peeks too (its sequences still run).
    decode_steps = NOREPEAT_TOKENS - 1
    assert counts == {"overlapped": 1 + decode_steps, "sync": 0}
    assert (st.num_spec_steps, st.num_paused_steps, st.num_unproposed_steps) == (0, 0, decode_steps + 1)
    assert llm.llm_engine.speculator.policy.empty_streak == 0


class _Nothing:
    """A host-side proposer that never has anything (an n-gram over text that does not repeat)."""
    proposes_on_host = True

    def has_proposals(self, reqs):
        return False

    def propose(self, reqs):
        return Proposals([[] for _ in reqs], None)

    def finish(self, seq_id):
        pass


class _PeekOnly(_Nothing):
    """Its peek finds something, its proposals never do: each step waits for the one in flight
    for nothing (what a stale history that matched and a fresh one that did not cost)."""
    def has_proposals(self, reqs):
        return True


@pytest.mark.parametrize("proposer", [_Nothing, _PeekOnly])
def test_host_side_proposer_with_nothing(setup, monkeypatch, proposer):
    model_dir, refs = setup
    ids, want = refs["texts"]
    llm = make_llm(model_dir, block_size=4, speculative_config=NGRAM_PAUSING)
    llm.llm_engine.speculator.proposer = proposer()
    counts = _counting(llm, monkeypatch)
    assert _greedy(llm, ids, MAX_TOKENS) == want
    st = llm.get_spec_decode_stats()
    decode_steps = MAX_TOKENS - 1
    # Nothing is ever verified, so every step launches overlapped, the prompts' step included.
    assert counts == {"overlapped": 1 + decode_steps, "sync": 0}
    assert st.num_spec_steps == 0 and st.num_draft_tokens == 0
    if proposer is _Nothing:  # nothing waited for: neither paused nor empty
        assert (st.num_paused_steps, st.num_unproposed_steps) == (0, decode_steps + 1)
    else:  # 23 decode steps: 8 empty steps (each waited), a pause of 8, an empty probe, 6 of a 16-step
        # pause, and the call that collects the last step's tokens (its sequences still run) is a 7th
        assert (st.num_paused_steps, st.num_unproposed_steps) == (8 + 7, 0)


def test_copy_heavy_prompts_still_speculate_and_accept(setup, monkeypatch):
    model_dir, refs = setup
    ids, want = refs["texts"]
    llm = make_llm(model_dir, block_size=4, speculative_config=NGRAM_PAUSING)
    counts = _counting(llm, monkeypatch)
    assert _greedy(llm, ids, MAX_TOKENS) == want
    st = llm.get_spec_decode_stats()
    # Every synchronous step verified proposals (none proposed for a sequence's last token, which
    # max_tokens leaves no room to verify); the steps whose peek found nothing ran overlapped.
    assert 0 < st.num_spec_steps == counts["sync"]
    assert st.num_unproposed_steps > 0 and counts["overlapped"] > 1
    assert st.num_accepted_tokens / st.num_draft_tokens > 0.5
