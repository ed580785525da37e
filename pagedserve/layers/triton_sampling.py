"""One pass over the logits for the plain sampling path: greedy or temperature, plus the chosen
token's raw logprob, in two Triton launches instead of eight to eleven torch ops.

Why: at 256 sequences of a 128k vocabulary the torch path (float copy, softmax, exponential
noise, divide, argmax, logsumexp) reads and writes the [n, vocab] float32 logits about ten times,
0.4 ms (greedy) to 0.84 ms (temperature 0.6) of a 10.5-11 ms Llama-3.1-8B decode step on the
H200 (benchmarks/results/h200/profile_decode_graphs_n256.json and
runs/d316dd1_profiles/profile_decode_graphs_n256_t0.6.json). This reads the logits once, in the
model's dtype, and writes nothing vocab-sized: that step took 10.23 ms instead of 10.77
(runs/fc14642_sampling/).

How: the vocabulary is cut into `splits` spans so that small batches still fill the GPU. Each
(row, span) program streams its span once and keeps, online:
  - the running max m and sum s of exp(x - m): the span's part of logsumexp(x);
  - the best score and its index: x itself (greedy) or, with temperature T, the race's winner
    and its Gumbel score x / T - log E (below).
A second launch merges a row's spans and writes the token and its raw logprob
x[token] - logsumexp(x), the distribution sampler.py reports (vLLM's "raw" logprobs).

The draw is the exponential race of sampler.py: argmin(E / p) with E = -log U ~ Exp(1) draws token
i with probability softmax(x/T)_i; a span keeps its least E * exp((m - x) / T) (m the largest
logit so far, rescaling the race as m grows) and reports the winner's Gumbel score x/T - log E,
which the merge compares across spans. U comes from Philox keyed by the step's seed: one call
(tl.randint4x, four outputs) per 4 tokens, counter row * ceil(vocab / 4) + index // 4, output
index % 4; so a row's draw depends on the step's seed, its row and the logits, never on how the
vocabulary was split. Until the 43rd session each token took a Philox call and two logs
(argmax(x/T - log(-log U)), Gumbel-max): 265 us a step at 256 rows of a 152k vocabulary on the
H200 (836bf4b's nanovllm profile), about one call's integer work per token. Now a quarter of those
rounds and one log a token (not yet timed).

Greedy is exact: argmax of the logits with ties to the lowest index, as torch.argmax, in any
dtype (float32 holds bfloat16 and float16 exactly, and converting keeps the order).

Imported lazily (pagedserve.layers.fused.fused_sampling); the torch path stays the CPU path and
the oracle. No host reads of device values: nothing here waits for the GPU.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedserve.host_math import stride_unit

# The default launch, from benchmarks/kernels/sampling_sweep.py on the H200 (46th session,
# runs/s46_gpu/ in benchmarks/results/h200/history.tar.gz): 16 programs per SM of 4 warps, a block
# of 2,048 tokens for a draw and 4,096 for argmax. Against the launch before (2 per SM, 2,048,
# 8 warps): greedy 71.7 -> 42.1 us at 256 x 151,936 (204.7 -> 123.4 at 1,000 x 128,256), a draw
# at temperature 182.8 -> 151.8 (570.3 -> 477.0); none of the four shapes timed got slower.
BLOCK = 2048
GREEDY_BLOCK = 4096
NUM_WARPS = 4
PROGRAMS_PER_SM = 16
MAX_SPLITS = 64
_FLOAT32_LOWEST = tl.constexpr(-3.0e38)  # a finite start for running maxima: exp(m - m_new) never sees inf - inf
# The race's exponents ((m - x) / T) are capped here: e^80 keeps E * e^80 finite, and a token more
# than 80 T below the largest logit (p < e^-80 of its) loses to that one, whose factor is 1, whatever
# the cap: E lies in [4.7e-10, 21.5] for a 32-bit U, a ratio of e^24.5 at most.
_RACE_EXP_CAP = tl.constexpr(80.0)


# Integer arguments that vary with the batch, the seed or the vocabulary are not specialised on
# (Triton would otherwise compile again for a value of 1 or a multiple of 16 met mid-serving). So
# that the compiler may still read 16 bytes an access, the row stride and the vocabulary come in
# units of UNIT (16 where both are multiples of 16, else 1) and the span in whole blocks: without
# that it cannot prove a row's span aligned and read the logits 2 bytes at a time (PTX
# ld.global.b16). On one H100 (61st session, docs/benchmarks-history.md): greedy 47.3 -> 37.0 us at
# 256 x 151,936, 145.2 -> 108.4 at 1,000 x 128,256; a draw at T=0.6 161.7 -> 131.7, 508.0 -> 413.0.
@triton.jit(do_not_specialize=["stride_units", "vocab_units", "span_blocks", "seed", "num_parts"])
def _span_kernel(logits_ptr, stride_units, vocab_units, span_blocks, temps_ptr, seed, part_ptr, num_parts,
                 GREEDY: tl.constexpr, BLOCK: tl.constexpr, UNIT: tl.constexpr = 1):
    """Program (row, split): its span's logsumexp parts and best score, into part_ptr[4, rows * splits]."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    vocab = vocab_units * UNIT
    lo = split * span_blocks * BLOCK
    hi = tl.minimum(lo + span_blocks * BLOCK, vocab)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_units * UNIT
    cols = tl.arange(0, BLOCK)
    if GREEDY:
        inv_t = 1.0
        gap_cap = 0.0
    else:
        t = tl.load(temps_ptr + row)
        inv_t = 1.0 / t
        gap_cap = _RACE_EXP_CAP * t  # logit gaps past this are capped before the division by T
    m = tl.full((), _FLOAT32_LOWEST, tl.float32)
    s = tl.zeros((), tl.float32)
    best = tl.full((), float("-inf"), tl.float32)  # greedy: the largest logit so far
    race = tl.full((), float("inf"), tl.float32)  # temperature: the least E * exp((m - x) / T) so far
    best_idx = lo
    groups = (vocab + 3) // 4  # a row's Philox counters: one per 4 tokens
    quads = tl.arange(0, BLOCK // 4)
    for start in range(lo, hi, BLOCK):
        idx = start + cols
        mask = idx < hi
        x = tl.load(row_ptr + idx, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        if GREEDY:
            chunk_best = tl.max(x, axis=0)
            chunk_idx = start + tl.argmax(x, axis=0, tie_break_left=True)
            take = chunk_best > best  # strict: an earlier chunk keeps a tie
            best = tl.where(take, chunk_best, best)
        else:
            # token 4g + k takes output k of counter g (start is a multiple of BLOCK, so of 4)
            r0, r1, r2, r3 = tl.randint4x(seed, row * groups + start // 4 + quads)
            bits = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), (BLOCK,))
            e = -tl.log(tl.uint_to_uniform_float(bits))  # Exp(1)
            # argmax(x / T - log E) = argmin(E * exp((m_new - x) / T)): one log a token, not two; the
            # factor is >= 1 (m_new is the largest logit so far), and the race so far is rescaled to it
            r = tl.where(mask, e * tl.exp(tl.minimum(m_new - x, gap_cap) * inv_t), float("inf"))
            race = race * tl.exp(tl.minimum(m_new - m, gap_cap) * inv_t)
            chunk_race = tl.min(r, axis=0)
            chunk_idx = start + tl.argmin(r, axis=0, tie_break_left=True)
            take = chunk_race < race  # strict: an earlier chunk keeps a tie
            race = tl.where(take, chunk_race, race)
        best_idx = tl.where(take, chunk_idx, best_idx)
        m = m_new
    if not GREEDY:
        best = m * inv_t - tl.log(race)  # the winner's x / T - log E, the Gumbel score the merge compares
    part = row * num_splits + split
    tl.store(part_ptr + part, m)
    tl.store(part_ptr + num_parts + part, s)
    tl.store(part_ptr + 2 * num_parts + part, best)
    tl.store(part_ptr + 3 * num_parts + part, best_idx.to(tl.float32))  # exact below 2**24


@triton.jit(do_not_specialize=["stride_row", "num_parts", "num_splits"])
def _merge_kernel(logits_ptr, stride_row, part_ptr, num_parts, num_splits, tokens_ptr, packed_ptr,
                  SPLITS: tl.constexpr):
    """Program row: merge its spans; the token (int64) and [token, logprob] as float64 (packed_ptr[row, 0:2])."""
    row = tl.program_id(0)
    k = tl.arange(0, SPLITS)
    mask = k < num_splits
    part = row * num_splits + k
    m = tl.load(part_ptr + part, mask=mask, other=_FLOAT32_LOWEST)
    s = tl.load(part_ptr + num_parts + part, mask=mask, other=0.0)
    best = tl.load(part_ptr + 2 * num_parts + part, mask=mask, other=float("-inf"))
    idx = tl.load(part_ptr + 3 * num_parts + part, mask=mask, other=0.0)
    m_all = tl.max(m, axis=0)
    lse = m_all + tl.log(tl.sum(s * tl.exp(m - m_all), axis=0))
    winner = tl.argmax(best, axis=0, tie_break_left=True)  # the lowest span: the lowest index
    token = tl.sum(tl.where(k == winner, idx, 0.0), axis=0).to(tl.int64)
    chosen = tl.load(logits_ptr + row.to(tl.int64) * stride_row + token).to(tl.float32)
    tl.store(tokens_ptr + row, token)
    tl.store(packed_ptr + 2 * row, token.to(tl.float64))
    tl.store(packed_ptr + 2 * row + 1, (chosen - lse).to(tl.float64))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: any value; a few, so the tests split the vocabulary


def logits_unit(logits: torch.Tensor) -> int:
    """The span kernel's UNIT: 16 where the row stride and the vocabulary are multiples of 16 (with
    the 16-byte aligned pointer Triton specializes on, every span then starts 16-byte aligned),
    else 1. One model's logits always take the same, so serving meets the warm-up's variant."""
    return stride_unit(logits.stride(0), logits.shape[1])


def supports(logits: torch.Tensor) -> bool:
    """Whether the kernels take these logits: 2-D, unit stride along the vocab, Philox counters
    (row * ceil(vocab / 4) + index // 4) within int32 (n * vocab < 2**31 bounds them), and
    indices exact in float32."""
    n, vocab = logits.shape if logits.dim() == 2 else (0, 0)
    return (logits.dim() == 2 and logits.stride(1) == 1 and n >= 1 and vocab < (1 << 24)
            and n * vocab < (1 << 31))


def split_count(num_rows: int, vocab: int, device: torch.device, programs_per_sm: int = PROGRAMS_PER_SM,
                block: int = BLOCK) -> int:
    """Spans per row: enough programs for programs_per_sm per SM, each span at least one block."""
    want = -(-programs_per_sm * _num_sms(device) // num_rows)
    return max(1, min(want, MAX_SPLITS, -(-vocab // block)))


def sample_rows(logits: torch.Tensor, temperatures: torch.Tensor | None, seed: int,
                splits: int | None = None, block: int | None = None,
                num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Row i: argmax (temperatures None) or a draw at temperatures[i] (> 0, float32 on the device).
    seed: in [0, 2**31) (one integer class: no recompile when it changes). Returns (tokens [n]
    int64, packed [n, 2] float64: token, raw logprob), as DeviceSample.packed(). splits, block
    (a power of two >= 4: tokens a loop iteration reads) and num_warps are the span kernel's launch,
    for benchmarks/kernels/sampling_sweep.py; the draw never depends on them."""
    if not supports(logits):
        raise ValueError(f"logits must be 2-D with unit vocab stride and n * vocab < 2**31, "
                         f"got shape {tuple(logits.shape)} strides {logits.stride()}")
    if not 0 <= seed < (1 << 31):
        raise ValueError(f"seed must be in [0, 2**31), got {seed}")
    n, vocab = logits.shape
    if block is None:
        block = GREEDY_BLOCK if temperatures is None else BLOCK
    if block < 4 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 4, got {block}")
    if splits is None:
        splits = split_count(n, vocab, logits.device, block=block)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be in [1, {MAX_SPLITS}], got {splits}")
    span_blocks = -(-vocab // (splits * block))  # whole blocks a span (one span: the vocabulary)
    splits = -(-vocab // (span_blocks * block))
    parts = torch.empty(4, n * splits, dtype=torch.float32, device=logits.device)
    greedy = temperatures is None
    temps = parts if greedy else temperatures  # any pointer when greedy: never read
    unit = logits_unit(logits)
    _span_kernel[(n, splits)](logits, logits.stride(0) // unit, vocab // unit, span_blocks, temps, seed, parts,
                              n * splits, GREEDY=greedy, BLOCK=block, UNIT=unit, num_warps=num_warps)
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    packed = torch.empty(n, 2, dtype=torch.float64, device=logits.device)
    _merge_kernel[(n,)](logits, logits.stride(0), parts, n * splits, splits, tokens, packed,
                        SPLITS=MAX_SPLITS, num_warps=1)
    return tokens, packed
