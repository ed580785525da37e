"""Prefill chunks sized by cost (core/chunk_cost.py) against a token-by-token count, and the
scheduler under SchedulerConfig.attention_cost_context."""
import pytest

from pagedserve.config import EngineConfig
from pagedserve.core.chunk_cost import CHUNK_ALIGN, chunk_cost, longest_chunk
from pagedserve.core.config import SchedulerConfig

from core_helpers import Driver, check_invariants, make_group, make_scheduler


def summed_cost(context: int, tokens: int, k: int) -> float:
    return sum(1 + (context + j) / k for j in range(tokens))


@pytest.mark.parametrize("k", [1, 7, 300, 26_600])
def test_chunk_cost_is_the_sum_over_its_tokens(k):
    for context in (0, 1, 5, 999, 40_000):
        for tokens in (0, 1, 2, 17, 600):
            exact = summed_cost(context, tokens, k)
            assert exact - 1e-6 <= chunk_cost(context, tokens, k) < exact + 1


@pytest.mark.parametrize("k", [3, 50, 26_600])
def test_longest_chunk_is_the_longest_that_fits(k):
    """Below half an aligned bucket: the longest chunk within the budget (brute force); all the
    tokens when they fit; 0 when one token does not."""
    for context in (0, 10, 333, 5_000, 120_000):
        for budget in (1, 2, 9, 64, 300):
            for tokens in (1, 5, 64, 500):
                want = max((c for c in range(tokens + 1) if summed_cost(context, c, k) <= budget + 1e-9
                            and chunk_cost(context, c, k) <= budget), default=0)
                assert want < CHUNK_ALIGN // 2
                assert longest_chunk(context, tokens, budget, k) == want, (context, budget, tokens)


def test_long_chunks_round_to_whole_buckets():
    """From half a bucket on, the chunk is the nearest whole multiple of CHUNK_ALIGN (the Hopper
    path pads queries to it), never more than the tokens left; Llama-3.1-8B's K over a 100k prompt
    with the H200's 8,192-token budget: shorter chunks as the context grows, 35 steps not 13."""
    k, budget = 26_600, 8_160
    fits = [max(c for c in range(0, 8_161, 16) if chunk_cost(p, c, k) <= budget) for p in (0, 50_000, 99_000)]
    got = [longest_chunk(p, 100_000 - p, budget, k) for p in (0, 50_000, 99_000)]
    assert got == [round(f / CHUNK_ALIGN) * CHUNK_ALIGN for f in fits[:2]] + [1_000]
    steps, context = [], 0
    while context < 100_000:
        steps.append(longest_chunk(context, 100_000 - context, budget, k))
        context += steps[-1]
    assert steps == sorted(steps, reverse=True) and all(c % CHUNK_ALIGN == 0 for c in steps[:-1])
    assert len(steps) == 35 and steps[0] == 7_168 and steps[-2] == 2_048


def test_scheduler_sizes_prefill_chunks_by_cost():
    """attention_cost_context=K: beside a running decode, a long prompt's chunk is the longest
    whose cost fits what the decode left of the budget, shorter as its context grows, and every
    token gets computed."""
    k = 10
    s = make_scheduler(128, max_num_batched_tokens=16, attention_cost_context=k)
    dec, long_ = make_group("d", [1, 2], max_tokens=40), make_group("l", list(range(100, 160)))
    s.add_seq_group(dec)
    d = Driver(s)
    d.step()  # d's prompt; it decodes from now on
    s.add_seq_group(long_)
    lens = []
    while sum(lens) < 60:  # the prompt's chunks (then it decodes)
        out = d.step()
        check_invariants(s)
        assert [(x.group.request_id, x.num_new_tokens) for x in out.scheduled][0] == ("d", 1)
        ((start, n),) = [(x.start, x.num_new_tokens) for x in out.scheduled if x.group is long_]
        assert n == longest_chunk(start, 60 - start, 15, k) and chunk_cost(start, n, k) <= 15
        lens.append(n)
    assert sum(lens) == 60 and lens == sorted(lens, reverse=True) and lens[0] > lens[-2]


def test_a_chunks_cost_comes_off_the_budget_of_later_prompts():
    """Beside a decode, the budget a costly chunk used is gone for the prompt after it (it gets what
    is left, by its own cost), not only the chunk's token count."""
    s = make_scheduler(128, max_num_batched_tokens=41, attention_cost_context=10)
    s.add_seq_group(make_group("d", [1, 2], max_tokens=8))
    d = Driver(s)
    d.step()  # d's prompt; it decodes from now on
    s.add_seq_group(make_group("l", list(range(100, 160))))
    s.add_seq_group(make_group("o", list(range(300, 305))))
    out = d.step()
    assert chunk_cost(0, 20, 10) == 39 and chunk_cost(0, 21, 10) > 40
    assert [(x.group.request_id, x.start, x.num_new_tokens) for x in out.scheduled] == \
        [("d", 2, 1), ("l", 0, 20), ("o", 0, 1)]


def test_without_decodes_chunks_take_the_whole_budget():
    """Costs count only in steps with a decode: prompts alone (nobody waits for a token) are cut by
    tokens, as without costs; once a decode runs beside the prompt, its chunks are cut by cost."""
    k, budget = 10, 16
    s = make_scheduler(128, max_num_batched_tokens=budget, attention_cost_context=k)
    long_ = make_group("l", list(range(100, 160)))
    s.add_seq_group(long_)
    d = Driver(s)
    plain = make_scheduler(128, max_num_batched_tokens=budget)
    plain.add_seq_group(make_group("l", list(range(100, 160))))
    d_plain = Driver(plain)
    for _ in range(2):
        got, want = d.step(), d_plain.step()
        assert [(x.start, x.num_new_tokens) for x in got.scheduled] == \
            [(x.start, x.num_new_tokens) for x in want.scheduled] == [(got.scheduled[0].start, budget)]
    # A prompt beside another's prompt (no decode yet): by tokens; beside its decode: by cost.
    s = make_scheduler(128, max_num_batched_tokens=budget, attention_cost_context=k)
    s.add_seq_group(make_group("d", [1, 2], max_tokens=40))
    s.add_seq_group(long_ := make_group("l", list(range(100, 160))))
    d = Driver(s)
    assert [(x.group.request_id, x.start, x.num_new_tokens) for x in d.step().scheduled] == \
        [("d", 0, 2), ("l", 0, budget - 2)]
    out = d.step()
    assert [(x.group.request_id, x.is_decode) for x in out.scheduled] == [("d", True), ("l", False)]
    n = out.scheduled[1].num_new_tokens
    assert n == longest_chunk(budget - 2, 60 - (budget - 2), budget - 1, k) < budget - 1
    check_invariants(s)


def test_short_sequences_are_chunked_by_tokens():
    """attention_cost_min_tokens=M: beside a decode, a prompt of fewer than M tokens is chunked by
    tokens; one of M or more by cost."""
    k, budget = 10, 16
    lens = {}
    for prompt in (59, 60):
        s = make_scheduler(128, max_num_batched_tokens=budget, attention_cost_context=k,
                           attention_cost_min_tokens=60)
        s.add_seq_group(make_group("d", [1, 2], max_tokens=40))
        d = Driver(s)
        d.step()
        s.add_seq_group(make_group("l", list(range(100, 100 + prompt))))
        d.step()  # l's first chunk (context 0)
        out = d.step()
        assert [x.is_decode for x in out.scheduled] == [True, False]
        lens[prompt] = (out.scheduled[1].start, out.scheduled[1].num_new_tokens)
    assert lens[59][1] == budget - 1
    start = lens[60][0]
    assert lens[60][1] == longest_chunk(start, 60 - start, budget - 1, k) < budget - 1


def test_config_checks():
    with pytest.raises(ValueError, match="attention_cost_context must be >= 0"):
        SchedulerConfig(attention_cost_context=-1)
    with pytest.raises(ValueError, match="long_prefill_cost_scale must be > 0"):
        EngineConfig(long_prefill_cost_scale=0)
    with pytest.raises(ValueError, match="long_prefill_budget_by_cost needs enable_chunked_prefill"):
        EngineConfig(long_prefill_budget_by_cost=True, enable_chunked_prefill=False)


@pytest.mark.parametrize("option", ["long_prefill_token_threshold", "long_prefill_chunk_align"])
def test_chunk_options_without_chunked_prefill_are_refused(option):
    """Both size prefill chunks, and with chunked prefill off the scheduler never cuts a prompt: set,
    they would be ignored without a word (as long_prefill_budget_by_cost would, refused above)."""
    with pytest.raises(ValueError, match=f"^{option} .*needs enable_chunked_prefill"):
        EngineConfig(**{option: 16}, enable_chunked_prefill=False)
    EngineConfig(**{option: 0}, enable_chunked_prefill=False)  # 0 is off: nothing to ignore
    assert getattr(EngineConfig(**{option: 16}), option) == 16
