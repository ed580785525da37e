"""Yield-adaptive pausing (spec_decode/policy.py): the policy's exact schedule of k for a sequence
of step yields (pauses, probes, backoff doubling to its cap, reset on a good probe, combined with
the batch rule); in the engine, proposals that are always rejected leave a bounded number of
speculating steps (the rest run overlapped), proposals that are always accepted never pause, and
greedy output equals decoding without speculation either way."""
import math

import pytest

from pagedserve import SamplingParams
from pagedserve.spec_decode.config import DEFAULT_MIN_SPECULATION_YIELD, SpeculativeConfig
from pagedserve.spec_decode.policy import (EMPTY_STEPS_BEFORE_PAUSE, FIRST_PAUSE_STEPS, MAX_EMPTY_PAUSE_STEPS,
                                           MAX_PAUSE_STEPS, YIELD_WEIGHT,
                                           SpeculationPolicy)
from pagedserve.spec_decode.synthetic import AcceptanceControlledProposer, ReplayProposer
from engine.helpers import assert_no_leak, make_llm, tokenizer
from spec_decode.spec_helpers import NGRAM_PAUSING as NGRAM, TEXTS, VerifiedProbes

T = 1.25  # the threshold the schedules below are worked out for


def schedule(policy, yields, decodes=1):
    """Run the policy over steps until `yields` runs out: each step asks for k (one decode unless
    `decodes` says otherwise) and a speculating step observes the next yield. Returns k per step,
    run-length encoded as [(k, steps)]."""
    ks, obs = [], iter(yields)
    while True:
        k = policy.tokens_to_propose(decodes)
        if k:
            y = next(obs, None)
            if y is None:
                break
            policy.observe(y)
        ks.append(k)
    return run_lengths(ks)


def run_lengths(ks):
    """[(k, steps)] for each run of equal values of ks."""
    runs = []
    for k in ks:
        if runs and runs[-1][0] == k:
            runs[-1][1] += 1
        else:
            runs.append([k, 1])
    return [tuple(r) for r in runs]


def test_default_threshold_and_constants():
    # The schedules below assume the shipped constants.
    assert (DEFAULT_MIN_SPECULATION_YIELD, YIELD_WEIGHT, FIRST_PAUSE_STEPS, MAX_PAUSE_STEPS) == (T, 0.25, 8, 256)


def test_pauses_probe_and_back_off_to_the_cap():
    # k = 2: the first step is a probe with one proposal (the fewest that can pay); its yield of 1
    # (gain 1 / 1.25 = 0.8) pauses at once. Then pauses of 8, 16, ... 256, 256, one probe between.
    p = SpeculationPolicy(2, 256, min_speculation_yield=T)
    assert schedule(p, [1.0] * 8) == [(1, 1), (0, 8), (1, 1), (0, 16), (1, 1), (0, 32), (1, 1), (0, 64), (1, 1),
                                      (0, 128), (1, 1), (0, 256), (1, 1), (0, 256), (1, 1), (0, 256)]
    assert p.num_paused_steps == 8 + 16 + 32 + 64 + 128 + 256 * 3


def test_a_good_probe_resumes_and_resets_the_backoff():
    p = SpeculationPolicy(2, 256, min_speculation_yield=T)
    # Gains are yields over 1.25 (no proposer cost).
    yields = ([1.0]               # the first step, a probe (k = 1), fails: pause 8
              + [1.0]             # failed probe: pause 16
              + [2.0]             # good probe (gain 1.6): the estimate restarts at 1.6, k = 2 again
              + [3.0] * 5         # gain 2.4: the mean (2.0, 2.13), then weight 0.25: 2.2, 2.25, 2.29
              + [1.0] * 7         # gain 0.8 at weight 0.25: below 1 after 7 steps (0.9985): pause 8, not 32
              + [T]               # a probe at exactly the threshold succeeds (estimate 1.0)
              + [1.0])            # the mean of 1.0 and 0.8 is 0.9 < 1: pause 8 again
    assert schedule(p, yields) == [(1, 1), (0, 8), (1, 1), (0, 16), (1, 1), (2, 12), (0, 8), (1, 1), (2, 1), (0, 8)]


def test_one_bad_step_in_a_good_run_does_not_pause():
    p = SpeculationPolicy(4, 256, min_speculation_yield=T)
    # Alternating 2 and 1 (gains 1.6 and 0.8): the first step, a probe of one proposal, pays and
    # resumes k = 4; the estimate settles between 1.14 and 1.26, above 1.
    assert schedule(p, [2.0, 1.0] * 50) == [(1, 1), (4, 99)]
    assert p.num_paused_steps == 0
    # A bad first step is all the evidence there is: it pauses (the next probe resumes a good run).
    assert schedule(SpeculationPolicy(4, 256, min_speculation_yield=T), [1.0, 2.0, 2.0]) == [
        (1, 1), (0, 8), (1, 1), (4, 1)]


@pytest.mark.parametrize("threshold", [0.0, 1.0])
def test_threshold_at_most_one_never_pauses(threshold):
    p = SpeculationPolicy(4, 256, min_speculation_yield=threshold)
    assert schedule(p, [1.0] * 500) == [(4, 500)]


def test_combined_with_the_batch_rule():
    p = SpeculationPolicy(2, 256, min_speculation_yield=T)
    assert p.tokens_to_propose(1) == 1  # the first step probes
    p.observe(1.0)
    assert p.pause_left == 8  # paused: 8 steps to go
    # 200 decodes: the batch rule alone says 0 (256 // 200 - 1); such steps do not count down.
    assert [p.tokens_to_propose(200) for _ in range(20)] == [0] * 20
    assert p.pause_left == 8 and p.num_paused_steps == 0
    # 100 decodes: the batch rule says k = 1; 8 paused steps, then the probe speculates with k = 1.
    assert [p.tokens_to_propose(100) for _ in range(9)] == [0] * 8 + [1]
    assert p.num_paused_steps == 8
    # A probe step in which no row got a proposal is not observed: the next step probes.
    assert p.tokens_to_propose(100) == 1
    p.observe(1.0)  # the probe fails: 16 steps, then a probe of one proposal
    assert [p.tokens_to_propose(1) for _ in range(17)] == [0] * 16 + [1]
    p.reset()  # the engine ran out of requests: a fresh estimate, the backoff from 8 again
    assert schedule(p, [1.0] * 2) == [(1, 1), (0, 8), (1, 1), (0, 16)]


@pytest.mark.parametrize("bad", [-0.5, 6.5, "1.5", True, float("nan")])
def test_threshold_refused_by_name(bad):
    with pytest.raises(ValueError, match="min_speculation_yield"):
        SpeculativeConfig.from_json(dict(NGRAM, min_speculation_yield=bad))
    assert SpeculativeConfig.from_json(NGRAM).min_speculation_yield == T
    assert SpeculativeConfig.from_json(dict(NGRAM, min_speculation_yield=5)).min_speculation_yield == 5.0


# --- in the engine ------------------------------------------------------------------------------
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    """Three prompts, their greedy outputs without speculation (the reference, and what the replay
    proposes), and the engine's vocabulary."""
    model_dir = tiny_model_dir("llama")
    tok = tokenizer(str(model_dir))
    ids = [tok.encode(t) for t in TEXTS[:3]]
    base = make_llm(model_dir, block_size=4)
    want = _greedy(base, ids)
    return model_dir, ids, want, base.llm_engine.vocab_size


def _greedy(llm, ids):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    assert_no_leak(llm)
    return [o.outputs[0].token_ids for o in outs]


def _run_with_acceptance(setup, acceptance, monkeypatch, verified=True):
    """Greedy with the replay of the reference output as the proposer, every proposed token
    corrupted with probability 1 - acceptance (0: all rejected, 1: all accepted). Returns the
    outputs, the speculator's stats and how many steps launched overlapped."""
    model_dir, ids, want, vocab = setup
    llm = make_llm(model_dir, block_size=4, speculative_config=NGRAM)
    engine = llm.llm_engine
    engine.speculator.proposer = AcceptanceControlledProposer(
        ReplayProposer([p + w for p, w in zip(ids, want)]), acceptance, vocab)
    if verified:  # probes verified in steps of their own (a draft model's); else shadow probes
        engine.speculator.proposer = VerifiedProbes(engine.speculator.proposer)
    launches = []
    launch = engine._launch
    monkeypatch.setattr(engine, "_launch", lambda *a: launches.append(1) or launch(*a))
    return _greedy(llm, ids), engine.speculator.stats, len(launches), llm


def _spec_steps_when_always_rejected(decode_steps):
    """Speculating steps among `decode_steps` when every step yields 1, from the rule: the first
    step is a probe, and fails, so it pauses; then pauses of 8, 16, ... (capped), with one probe
    after each."""
    steps, at, pause = 1, 1, FIRST_PAUSE_STEPS
    while at + pause + 1 <= decode_steps:
        at += pause + 1
        steps += 1
        pause = min(2 * pause, MAX_PAUSE_STEPS)
    return steps


def test_always_rejected_pauses_and_keeps_outputs(setup, monkeypatch):
    got, stats, launches, llm = _run_with_acceptance(setup, 0.0, monkeypatch)
    assert got == setup[2]
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == 0
    # 47 decode steps (one token each): probes (k = 1) at the first step and after 8 and 16 paused
    # steps (steps 10 and 27; the next would be step 60). The replay is a host-side proposer: its
    # peeks find proposals, so these steps go synchronous as before.
    decode_steps = MAX_TOKENS - 1
    expected = _spec_steps_when_always_rejected(decode_steps)
    assert expected == 3
    assert stats.num_spec_steps == expected
    # Every other step while the requests ran was paused, and ran overlapped (launched without
    # waiting): the other decode steps, and the one that collects the last overlapped step's tokens.
    assert stats.num_paused_steps == decode_steps - expected + 1
    assert launches == 1 + decode_steps - expected  # the prompts' step too (no decodes yet: k = 0)
    # The engine ran out of requests: the same batch again starts from a fresh estimate and
    # speculates in the same steps (not in the middle of the last run's 32-step pause).
    assert _greedy(llm, setup[1]) == setup[2]
    assert stats.num_spec_steps == 2 * expected


def test_always_accepted_never_pauses(setup, monkeypatch):
    got, stats, launches, _ = _run_with_acceptance(setup, 1.0, monkeypatch)
    assert got == setup[2]
    assert stats.num_paused_steps == 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    # Every decode step speculated, synchronously (only the prompts' step launched overlapped): the
    # first, a probe, emits 2 tokens, the others k + 1 = 5 (the last one trimmed by max_tokens).
    assert stats.num_spec_steps == 1 + math.ceil((MAX_TOKENS - 1 - 2) / 5)
    assert launches == 1


# --- nothing proposed -----------------------------------------------------------------------------
def empty_schedule(policy, steps, decodes=1):
    """k per step over `steps` steps when every speculating step proposes nothing, run-length encoded."""
    ks = []
    for _ in range(steps):
        k = policy.tokens_to_propose(decodes)
        if k:
            policy.observe_empty()
        ks.append(k)
    return run_lengths(ks)


def test_steps_with_nothing_proposed_pause_and_back_off_to_their_own_cap():
    assert (EMPTY_STEPS_BEFORE_PAUSE, MAX_EMPTY_PAUSE_STEPS) == (8, 32)
    p = SpeculationPolicy(4, 256, min_speculation_yield=T)
    # Nothing observed: the first step's probe (one proposal) stays due until a step has proposals.
    assert empty_schedule(p, 8 + 8 + 1 + 16 + 1 + 32 + 1 + 32 + 1) == [
        (1, 8), (0, 8), (1, 1), (0, 16), (1, 1), (0, 32), (1, 1), (0, 32), (1, 1)]
    assert p.observed == 0 and p.estimate == math.inf  # no yield was observed


def test_a_step_with_proposals_ends_the_streak_and_resets_its_backoff():
    p = SpeculationPolicy(4, 256, min_speculation_yield=T)
    assert empty_schedule(p, 8 + 8 + 1 + 16) == [(1, 8), (0, 8), (1, 1), (0, 16)]
    assert p.tokens_to_propose(1) == 1  # the probe
    p.observe(2.0)  # the text began to repeat: the probe's proposal is accepted, full k again
    assert empty_schedule(p, 7) == [(4, 7)]  # a new streak: 7 empty steps do not pause
    assert empty_schedule(p, 1 + 8) == [(4, 1), (0, 8)]  # the 8th does, for 8 again
    # After a pause for nothing proposed, speculation restarts with a probe too.
    assert p.tokens_to_propose(1) == 1


@pytest.mark.parametrize("threshold", [0.0, 1.0])
def test_nothing_proposed_never_pauses_with_pausing_off(threshold):
    p = SpeculationPolicy(4, 256, min_speculation_yield=threshold)
    assert empty_schedule(p, 100) == [(4, 100)]


class _NothingProposer:
    """A proposer that never has anything (an n-gram over text that does not repeat)."""
    def propose(self, reqs):
        from pagedserve.spec_decode.proposer import Proposals
        return Proposals([[] for _ in reqs], None)

    def finish(self, seq_id):
        pass


def test_an_engine_whose_proposer_finds_nothing_runs_overlapped(setup, monkeypatch):
    model_dir, ids, want, _ = setup
    llm = make_llm(model_dir, block_size=4, speculative_config=NGRAM)
    engine = llm.llm_engine
    engine.speculator.proposer = _NothingProposer()
    launches = []
    launch = engine._launch
    monkeypatch.setattr(engine, "_launch", lambda *a: launches.append(1) or launch(*a))
    assert _greedy(llm, ids) == want
    # 47 decode steps: 8 synchronous empty steps, a pause of 8, a probe, 16, a probe, then 13 of a
    # 32-step pause; every paused step (and the prompts' step) launched overlapped.
    decode_steps, sync = MAX_TOKENS - 1, 8 + 1 + 1
    assert engine.speculator.stats.num_spec_steps == 0 and engine.speculator.stats.num_draft_tokens == 0
    assert engine.speculator.stats.num_paused_steps == decode_steps - sync + 1
    assert len(launches) == 1 + decode_steps - sync


# --- what a proposal costs ------------------------------------------------------------------------
def test_a_draft_as_large_as_the_target_never_speculates():
    # cost 1: a step of k proposals costs 1 + k target steps; not even a fully accepted one (1 + k
    # tokens) reaches 1.25 x (1 + k). Not a pause: nothing is ever asked, nothing counted.
    p = SpeculationPolicy(4, 256, min_speculation_yield=T, proposer_cost=1.0)
    assert [p.tokens_to_propose(d) for d in (1, 8, 50)] == [0, 0, 0] and p.num_paused_steps == 0
    # With pausing off (the benchmarks' fixed-k runs) the cost is not looked at.
    assert SpeculationPolicy(4, 256, min_speculation_yield=0.0, proposer_cost=1.0).tokens_to_propose(1) == 4


def test_the_threshold_and_the_probe_follow_the_cost():
    p = SpeculationPolicy(4, 256, min_speculation_yield=T, proposer_cost=0.5)
    assert p.threshold(4) == pytest.approx(3.75) and p.threshold(1) == pytest.approx(1.875)
    # Probes have one proposal (2 tokens >= 1.875 can pay): the first one's 2.0 (gain 1.07) resumes
    # k = 4; a yield of 3 at k = 4 is a gain of 0.8 (it would pay without the draft's cost), the
    # mean 0.93: pause 8, then a probe.
    assert schedule(p, [2.0, 3.0, 2.0, 5.0]) == [(1, 1), (4, 1), (0, 8), (1, 1), (4, 1)]
    # Dearer proposals: one cannot pay (2 < 1.25 x 1.7), two can (3 >= 1.25 x 2.4): probes of 2;
    # a batch where the batch rule allows only k = 1 does not speculate, and does not count down.
    q = SpeculationPolicy(4, 256, min_speculation_yield=T, proposer_cost=0.7)
    assert q.probe_k(4) == 2 and not q.pays(1) and q.pays(2)
    assert q.tokens_to_propose(100) == 0 and q.num_paused_steps == 0


def test_shadow_probes_when_always_rejected_run_no_synchronous_step(setup, monkeypatch):
    """The replay can propose on the host (peek_proposals), so its probes are shadow probes
    (spec_decode/shadow.py): taken over the host's histories in an overlapped step and scored a
    few steps later, once the tokens they proposed for are on the host. Each is decided two steps
    after it was taken (the token then in flight arrives, the proposals are made; the next token
    refutes them) and pauses 8 steps, without backing off (it costs no device time): probes at
    decode steps 1, 11, 21, 31 and 41, where verified ones came at 1, 10 and 27 (pauses of 8, then
    16). No step waits: every decode step launched overlapped."""
    got, stats, launches, llm = _run_with_acceptance(setup, 0.0, monkeypatch, verified=False)
    assert got == setup[2]
    decode_steps = MAX_TOKENS - 1
    assert stats.num_spec_steps == 0 and stats.num_draft_tokens == 0
    assert stats.num_shadow_probes == len(range(1, decode_steps + 1, 2 + FIRST_PAUSE_STEPS)) == 5
    assert launches == 1 + decode_steps
    assert _greedy(llm, setup[1]) == setup[2]  # a fresh estimate again: the same probes
    assert stats.num_shadow_probes == 10


def test_a_shadow_probe_that_pays_resumes_speculation_two_steps_later(setup, monkeypatch):
    """Every proposal accepted: the first decode step's shadow probe proposes once the token then
    in flight reaches the host (the second decode step, withheld: one paused step) and pays as soon
    as its first proposal matches, one step later (yield >= 2 > 1.25), so speculation runs at full
    k from the third decode step on: three overlapped decode steps' tokens, then synchronous steps
    of k + 1 = 5 tokens, 45 = 9 x 5 of them."""
    got, stats, launches, _ = _run_with_acceptance(setup, 1.0, monkeypatch, verified=False)
    assert got == setup[2]
    assert stats.num_shadow_probes == 1 and stats.num_paused_steps == 1
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert stats.num_spec_steps == (MAX_TOKENS - 3) // 5 == 9
    assert launches == 3  # the prompts' step and the first two decode steps
