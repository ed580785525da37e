"""Prefill chunks sized by what they cost, not by their token count (SchedulerConfig.attention_cost_context).

A step's time is roughly its matmuls, one unit per token, plus each prefill token's attention over
the context before it. With a plain token budget, a chunk of a long prompt costs more and more as
its context grows: on the H200 an 8,192-token chunk of Llama-3.1-8B takes ~0.1 s at the start of a
100k prompt and ~0.95 s at its end (docs/long-context.md), and every decode beside it waits that
long for its next token. Counting a token after P earlier ones as 1 + P / K units of the budget
(K: the context at which its attention costs as much as its matmuls, model_cost.py) keeps each
step near the time of a budget's worth of context-free tokens: the late chunks get shorter, there
are more of them, and the decodes beside them get a token each time. The scheduler counts costs only
in steps with a decode (or a speculative row): with nobody waiting for a token, whole chunks
prefill fastest.

A chunk of c tokens after P costs sum over j < c of (1 + (P + j) / K) = c + (c * P + c * (c - 1) / 2) / K.
"""
from __future__ import annotations

import math

# A capped chunk of at least half this is rounded to the nearest whole multiple of it: the Hopper
# long-prefill path (attention/gathered_prefill.py) pads a chunk's queries to whole buckets of 1,024
# tokens, so a chunk of 1,700 would pay for 2,048 rows of attention and cutting it to 1,024 would
# waste 40% of the step; its cost may pass the budget by up to half a bucket's.
CHUNK_ALIGN = 1024
# The engine counts costs only for sequences of at least this many tokens (SchedulerConfig.
# attention_cost_min_tokens): a shorter prompt's chunks never cost much over their tokens (at most
# ~1.15x at Llama-3.1-8B's K), and short-prompt serving keeps the schedule it was measured with.
COST_MIN_TOKENS = 8192
# The engine's K is the model's compute balance (model_cost.attention_cost_context) times this
# (EngineConfig.long_prefill_cost_scale). 1 until the 37th session: a step beside decodes then cost
# about a budget of context-free tokens (~0.2 s for Llama-3.1-8B on the H200), and a fresh 100k
# prompt beside one decode took 39 steps and 7.18 s (7.00 alone), which the decode beside it waited
# out, while its gaps (p99 0.24 s against vLLM's 0.84) had room to spare. At 2 (A/B offline,
# docs/long-context.md): 30 steps, 7.07 s, gaps p99 0.34 s.
COST_SCALE = 2.0


def chunk_cost(context: int, tokens: int, k: int) -> int:
    """Budget units of `tokens` new tokens after `context` earlier ones (rounded up)."""
    return tokens + -(-(tokens * context + tokens * (tokens - 1) // 2) // k)  # exact integer ceil


def longest_chunk(context: int, tokens: int, budget: int, k: int) -> int:
    """The most of `tokens` new tokens after `context` earlier ones whose cost fits `budget`: all
    of them if they fit, else the longest that does (0 if not even one token does), rounded to the
    nearest whole CHUNK_ALIGN tokens from half of that on, never past `tokens`."""
    if tokens <= 0 or budget <= 0:
        return 0
    if chunk_cost(context, tokens, k) <= budget:
        return tokens
    # Largest real c with c + (c * context + c * (c - 1) / 2) / k <= budget, then exact on integers.
    b = k + context - 0.5
    c = int((-b + math.sqrt(b * b + 2 * k * budget)))
    c = max(0, min(c, tokens))
    while c > 0 and chunk_cost(context, c, k) > budget:
        c -= 1
    while c + 1 <= tokens and chunk_cost(context, c + 1, k) <= budget:
        c += 1
    if c < CHUNK_ALIGN // 2:
        return c
    return min(tokens, max(CHUNK_ALIGN, round(c / CHUNK_ALIGN) * CHUNK_ALIGN))
