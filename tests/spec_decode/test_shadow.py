"""Shadow probes (spec_decode/shadow.py): scoring proposals against the tokens decoding emitted,
exactly as a verified probe would have accepted them, and the policy's decisions on them."""
import random

from pagedserve.spec_decode.policy import FIRST_PAUSE_STEPS, SpeculationPolicy
from pagedserve.spec_decode.proposer import ProposalRequest
from pagedserve.spec_decode.rejection import VerifyRow, rejection_sample
from pagedserve.spec_decode.shadow import ShadowProbe


def req(seq_id, k=3):
    return ProposalRequest(seq_id, [], k, 0.0, None)


def lookup(table):
    """A stand-in proposer: proposals by the history's last token."""
    return lambda r: table.get(r.token_ids[-1], [])


def test_rows_proposed_once_their_history_is_there_then_scored_as_tokens_arrive():
    # seq 1 proposes over 3 tokens, seq 2 over 2, seq 3 over 4 (its last one still in flight).
    probe = ShadowProbe(3, {1: (3, req(1)), 2: (2, req(2)), 3: (4, req(3))}, max_steps=6)
    propose = lookup({10: [5, 6, 7], 20: [9, 9], 30: [4], 31: []})
    probe.advance({1: [0, 0, 10], 2: [0, 20], 3: [0, 0, 0]}.get, propose)
    # 1 and 2 proposed (nothing of theirs known yet), 3 waits for its 4th token: 0..3 accepted.
    assert set(probe.pending) == {1, 2} and set(probe.waiting) == {3}
    assert not probe.done and probe.bounds() == (1.0, 1.0 + (3 + 2 + 3) / 3)
    probe.advance({1: [0, 0, 10, 5, 6], 2: [0, 20, 8], 3: [0, 0, 0, 30]}.get, propose)
    # seq 2 rejected at once (0 accepted); seq 1 matched 2 of 3 so far; seq 3 proposed [4].
    assert probe.accepted == [0] and probe.bounds() == (1.0 + 2 / 3, 1.0 + 4 / 3)
    probe.advance({1: [0, 0, 10, 5, 6, 7, 1], 3: [0, 0, 0, 30, 4]}.get, propose)
    assert probe.done and sorted(probe.accepted) == [0, 1, 3] and probe.bounds() == (1.0 + 4 / 3,) * 2


def test_rows_that_propose_nothing_end_or_wait_too_long_are_dropped():
    probe = ShadowProbe(2, {1: (2, req(1, 2)), 2: (2, req(2, 2)), 3: (1, req(3, 2))}, max_steps=2)
    propose = lookup({10: [3, 4], 31: []})
    probe.advance({1: [0, 10], 3: [31]}.get, propose)  # 2 is gone, 3 proposes nothing: dropped
    assert not probe.done and probe.bounds() == (1.0, 3.0)
    probe.advance({1: [0, 10, 3]}.get, propose)  # 1 still waits for its second token: the step limit
    assert probe.done and probe.bounds() is None


def test_shadow_score_has_the_verified_acceptance_distribution():
    """For a one-hot proposal, the common prefix of the proposals with tokens sampled from the
    target has the distribution of the rejection sampler's accepted count: compared by their
    means over many draws on a 3-token vocabulary (the chi-square tests of rejection.py cover the
    sampler itself)."""
    import torch
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.3, 0.3, 0.4]])  # positions 0..2
    proposal = [0, 1]
    n = 4000
    verified = rejection_sample(probs.repeat(n, 1), [VerifyRow(proposal, False, None)] * n, None, g)
    ver_mean = sum(verified.num_accepted) / n
    rng = random.Random(1)
    shadow = 0
    for _ in range(n):
        toks = [rng.choices(range(3), weights=probs[j].tolist())[0] for j in range(2)]
        p = ShadowProbe(2, {0: (0, req(0, 2))}, max_steps=1)
        p.advance({0: toks}.get, lambda r: proposal)
        shadow += p.accepted[0]
    expected = 0.6 + 0.6 * 0.5  # P(first accepted) + P(both)
    assert abs(ver_mean - expected) < 0.05 and abs(shadow / n - expected) < 0.05


def test_policy_withholds_while_scored_then_decides_as_a_probe():
    p = SpeculationPolicy(4, 128, min_speculation_yield=1.25)
    assert p.probing and p.tokens_to_propose(1) == 1  # a probe is due
    p.begin_shadow()
    assert [p.tokens_to_propose(1) for _ in range(3)] == [0, 0, 0] and p.num_paused_steps == 3
    p.observe_shadow(1.0, 4)  # rejected: pause FIRST_PAUSE_STEPS, then probe again
    ks = [p.tokens_to_propose(1) for _ in range(FIRST_PAUSE_STEPS + 1)]
    assert ks == [0] * FIRST_PAUSE_STEPS + [1]
    p.begin_shadow()
    p.observe_shadow(1.5 / 1.25 - 0.01, 4)  # fails again: the same short pause, no backoff
    ks = [p.tokens_to_propose(1) for _ in range(FIRST_PAUSE_STEPS + 1)]
    assert ks == [0] * FIRST_PAUSE_STEPS + [1]
    p.begin_shadow()
    p.cancel_shadow()  # its sequences ended unscored: the probe stays due
    assert p.probing and p.tokens_to_propose(1) == 1
    p.begin_shadow()
    p.observe_shadow(3.0, 4)  # pays: full k, the estimate from its gain
    assert not p.probing and p.tokens_to_propose(1) == 4 and p.estimate == 3.0 / 1.25
