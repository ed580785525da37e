"""The decode launch plan: how the split-K decode kernel (triton_decode.py) is launched, decided
on the host before each launch. triton_ops.paged_decode launches what this module plans.

What it decides:
- the launch's shape (DecodeLaunch: BLOCK_N, warps, stages, the grid's fastest axis, rows
  longest first, and over an fp8 cache the f16 cast): defaults measured on the H200, changed for
  an A/B by PAGEDSERVE_DECODE_LAUNCH, and over an fp8 cache by DECODE_FP8_LAUNCH or
  PAGEDSERVE_DECODE_LAUNCH_FP8 in its place (decode_launch_for);
- the splits: base splits per sequence so that the grid fills the GPU (choose_num_splits), the
  grid's splits, more for long sequences as PAGEDSERVE_DECODE_SPLIT_TOKENS says (grid_splits),
  balanced, and the slots' grid a skewed step takes instead (slot_parts, balanced_slots), and the
  split mode the kernels get (decode_launch);
- for decode CUDA graphs: the split modes a graph is captured with (graph_split_modes) and
  the one a step replays (pick_split_mode);
- what a launch compiles per (decode_compile_key), so that the warm-up covers each variant.

Why on the host: a decode graph is captured once per batch size and split mode, so its grid
cannot follow a step's lengths; the kernels cut each sequence themselves (triton_decode's plans,
from seq_lens on the device) within the grid planned here, and pick_split_mode mirrors that cut
from the host's copy of the same lengths to pick the graph.

Invariants:
- Nothing here syncs the device: every input is a Python number, a host list of lengths, a dtype
  or the device's SM count (read once per device).
- The switches are read once per process (functools caches: a test that sets one clears the
  cache of the function that reads it).
- The grid never has fewer splits than the base; the kernels get split mode 0 unless it has more.
- Planned splits (base, the balanced rows' grid and its slots' grid) give one sequence at most one
  wave of programs (wave_splits).
- A SLOTS launch's slots (balanced_slots) hold every split its plan can make.
- A graph's split mode is fixed at its capture (AttentionMetadata.decode_split_tokens): one graph
  per mode of graph_split_modes, and pick_split_mode returns one of those (0, BALANCED, SLOTS).
- pick_split_mode counts tiles of the BLOCK_N the launch over that cache walks (decode_launch_for).

The backend module exposes this one as triton_ops.decode_plan: the runner (cuda_graph.py,
warmup.py) finds it there, and the plain-torch reference backend has none.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from pagedserve.attention.kv_quant import FP8_KV_DTYPE
from pagedserve.host_math import cdiv, next_power_of_2

# Launch defaults; benchmarks/kernels/bench_paged_decode.py sweeps the decode ones on the GPU, and
# benchmarks/kernels/decode_variants.py the grid order with them. On the H200 (runs/cb44d75_decode_variants/)
# 128-position tiles, KV heads as the grid's fastest axis and rows longest first together took a
# graph-launched decode from 232 to 199 us at 256 sequences of nanovllm's contexts (3.7 to 4.3 TB/s
# of K/V), 164 to 129 us over serving's at 256, 477 to 462 us at fixed256's 1000 even ones.
DECODE_BLOCK_N = 128
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 3
# An A/B of the decode launch without a code change (read once per process): '+'-joined changes
# to the defaults, named as decode_variants.py names them: rows (sequences the grid's fastest
# axis), nolpt (rows in row order), bnN (N-position tiles), wN (warps), sN (pipeline stages).
# E.g. PAGEDSERVE_DECODE_LAUNCH=rows+nolpt+bn64 is the launch before 925e530.
DECODE_LAUNCH_ENV = "PAGEDSERVE_DECODE_LAUNCH"
# An FP8 (e4m3) KV cache's decode has a launch of its own: its tiles move half the bytes of a bf16
# tile, and on the H200 at 52fbedc (fp8_kv_scales.py, 64 x 4096, Llama-3.1-8B attention) the bf16
# launch took 0.282 ms over an fp8 cache against ~0.25 ms over bf16's twice the bytes. These are
# its changes to the launch above (decode_launch_settings(), the switch included), in the
# switch's names plus f16: the dot in fp16, q cast to fp16 (saturated to +-65504) and the tiles
# cast e4m3 -> fp16 (one packed cvt on sm_89+; e4m3 -> bf16 is that cvt and a cvt per element
# after), instead of the tiles cast to q's dtype. "" keeps the bf16 launch. The sweep on the H200
# (benchmarks/kernels/fp8_decode_sweep.py, 2026-12-02, fp8_parts/fp8_decode_sweep.json): the f16
# cast at the bf16 launch was fastest at all four shapes, 0.83-0.96x of the bf16 kernel's time.
DECODE_FP8_LAUNCH = "f16"
# Replaces DECODE_FP8_LAUNCH without a code change (read once per process); "base": the bf16 launch.
DECODE_FP8_LAUNCH_ENV = "PAGEDSERVE_DECODE_LAUNCH_FP8"
MAX_SPLITS = 64
MIN_TOKENS_PER_SPLIT = 256
DECODE_PROGRAMS_PER_SM = 3
# Length-aware splits (triton_decode.split_plan, balanced_chain_tiles): a long sequence gets more splits than the batch
# size asks for. PAGEDSERVE_DECODE_SPLIT_TOKENS sets how (read once per process): 0 off, N > 0
# splits of about N positions, "balanced" (the default) splits no longer than an even share of the
# step's work. Fixed sizes on the H200 (benchmarks/kernels/decode_skew.py, runs/2cf31a8_decode_skew/): 512
# took a graph-launched decode over serving's uneven contexts from 70.3 to 52.7 us at 64
# sequences, but over even contexts of the same total from 39.6 to 50.5 us: the grid was sized
# for max_model_len, each program past a sequence's last split still costs a launch, and so does
# the reduction. "balanced" cuts only what would outlast an even share of the step, and a decode
# graph replays it only for steps whose lengths gain from it (pick_split_mode), in the rows' grid
# or, for a skewed step, in the slots' (SLOTS, below).
BALANCED = -1
DECODE_SPLIT_TOKENS = BALANCED
# The balanced cut in the slots' grid: a kernel mode that decode graphs (pick_split_mode) choose,
# never the switch's value.
SLOTS = -2
SPLIT_TOKENS_ENV = "PAGEDSERVE_DECODE_SPLIT_TOKENS"
# The balanced plan's even share: all of a step's tiles over this many programs per SM. An SM runs
# about 2 decode programs at once at the launch defaults above (inferred from the even case's time
# per tile), but a long chain that starts last ends late, so a cut pays from about twice that: on
# the H200 (decode_skew.py at a7ed567) 4 per SM was best or within 5% of it at 16-128 sequences over
# serving's contexts; 1 per SM cut too little. 6 since (bench_paged_decode.py --shares at 47a9b2e,
# docs/long-context.md): 9-13% faster than 4 at 2 and 4 x 100k and at 16 and 64 x 4,096 tokens,
# level at one 100k sequence (where the wave cap below decides), and serving's decode steps took
# the same time under either at every batch size (the H200 at d004244).
DECODE_SHARE_PROGRAMS_PER_SM = 6
# Replaces it without a code change (read once per process), for an A/B.
DECODE_SHARE_ENV = "PAGEDSERVE_DECODE_SHARE"
# The balanced plan's rows' grid (KV head, sequence x split) keeps within this many programs per SM
# (at least 2 splits a row), since each program past a sequence's last split still costs a launch.
DECODE_GRID_PROGRAMS_PER_SM = 8
# But then at 16 rows a sequence has at most 9 splits, and one 32k-token sequence decoding beside
# short ones walked chains of 29 tiles where the share asked for 3-4 (on the H200 such decode steps
# took 7.8 ms against vLLM's 6.2; docs/long-context-history.md, 41st session). A step whose longest chain
# the rows' grid lengthens that much runs in the slots' grid instead (SLOTS, triton_decode.slot_plan):
# the rows' splits one after another, so the long one may take up to one wave (slot_parts) while
# each short one takes its own few. Its scans over the rows cost each program a little (at 8-64
# rows 0.3-0.5 us a row a launch, measured with the slots' grid for every balanced step: 5865b07),
# so a graph replay takes it only where the chain it saves, in tiles, exceeds SLOT_MIN_GAIN_TILES
# + rows / SLOT_ROWS_PER_TILE (takes_slots; a tile of one program ~1.7 us in the same run: 100 ->
# 61 us a launch at 16 rows as chains went from 29 to 6 tiles). The choice is the host's, one graph
# per mode: made inside the kernels (41st session) it cost the rows' grid 6-13% at 8-64 rows of
# serving's and even contexts on the H200, where the step kept the rows (42nd session,
# docs/long-context.md).
SLOT_MIN_GAIN_TILES = 2
SLOT_ROWS_PER_TILE = 6
# Replaces SLOT_MIN_GAIN_TILES without a code change (read once per process), for an A/B: a large
# negative value sends every balanced step to the slots' grid, a large one (1000000) none.
SLOT_GAIN_ENV = "PAGEDSERVE_DECODE_SLOT_GAIN"
#
# Neither the base nor the balanced plan gives one sequence more programs than one wave (DECODE_PROGRAMS_PER_SM
# per SM, wave_splits): on the H200 (runs/s29_long_context/decode_long_b*.json) one 100k sequence of
# 8 KV heads took 0.146 ms a layer at the plan's 512 programs and 0.135 at 64 splits (512), but
# 0.118 at 48 (384, one wave of 396); the one-wave plan 0.115 against the share's 0.132 at 47a9b2e.
# It binds only where one sequence could have more: a step of one or two long sequences.
# A step takes the balanced plan only if it shortens the longest chain by more than this many
# tiles: its extra programs and the reduction cost about 3.7 us at 64 even sequences, ~1.6 tiles.
BALANCED_MIN_GAIN_TILES = 2


@dataclass(frozen=True)
class DecodeLaunch:
    block_n: int = DECODE_BLOCK_N
    num_warps: int = DECODE_NUM_WARPS
    num_stages: int = DECODE_NUM_STAGES
    heads_fastest: bool = True
    longest_first: bool = True
    f16_dot: bool = False  # fp8 caches only: tiles cast to fp16 and q to fp16 (DECODE_FP8_LAUNCH)


def parse_decode_launch(text: str, base: DecodeLaunch | None = None, fp8: bool = False) -> DecodeLaunch:
    """'base' or '' (base, default DecodeLaunch()), or '+'-joined changes to it (see DECODE_LAUNCH_ENV);
    fp8: an fp8 cache's launch (DECODE_FP8_LAUNCH_ENV), which may also name f16."""
    env = DECODE_FP8_LAUNCH_ENV if fp8 else DECODE_LAUNCH_ENV
    kw: dict = {}
    for part in filter(None, text.strip().split("+")):
        number = part.lstrip("bnws")
        if part == "base":
            continue
        elif part == "rows":
            kw["heads_fastest"] = False
        elif part == "nolpt":
            kw["longest_first"] = False
        elif part == "f16" and fp8:
            kw["f16_dot"] = True
        elif number.isdigit() and part[:-len(number)] in ("bn", "w", "s") and int(number) > 0:
            kw[{"bn": "block_n", "w": "num_warps", "s": "num_stages"}[part[:-len(number)]]] = int(number)
        else:
            names = "rows, nolpt, bnN, wN, sN" + (", f16" if fp8 else "")
            raise ValueError(f"{env} parts are {names} joined by '+', got {part!r} in {text!r}")
    launch = dataclasses.replace(base or DecodeLaunch(), **kw)
    if launch.block_n < 16 or launch.block_n & (launch.block_n - 1):
        raise ValueError(f"{env}: bnN must be a power of two >= 16, got {launch.block_n}")
    return launch


@functools.lru_cache(maxsize=None)
def decode_launch_settings() -> DecodeLaunch:
    """paged_attention's decode launch: the defaults, or as DECODE_LAUNCH_ENV changes them."""
    return parse_decode_launch(os.environ.get(DECODE_LAUNCH_ENV, ""))


@functools.lru_cache(maxsize=None)
def fp8_decode_launch_settings() -> DecodeLaunch:
    """An fp8 cache's decode launch: decode_launch_settings() changed by DECODE_FP8_LAUNCH, or by
    DECODE_FP8_LAUNCH_ENV in its place."""
    return parse_decode_launch(os.environ.get(DECODE_FP8_LAUNCH_ENV, DECODE_FP8_LAUNCH),
                               base=decode_launch_settings(), fp8=True)


def decode_launch_for(kv_dtype: torch.dtype | None) -> DecodeLaunch:
    """The decode launch over a cache of kv_dtype (None: the bf16 / fp16 / fp32 one)."""
    return fp8_decode_launch_settings() if kv_dtype == FP8_KV_DTYPE else decode_launch_settings()


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def decode_split_tokens() -> int:
    """The switch's value: 0 (off), a split size in positions, or BALANCED."""
    raw = os.environ.get(SPLIT_TOKENS_ENV, "").strip()
    if not raw:
        return DECODE_SPLIT_TOKENS
    if raw == "balanced":
        return BALANCED
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{SPLIT_TOKENS_ENV} must be 'balanced' or a whole number of tokens (0: off), "
                         f"got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{SPLIT_TOKENS_ENV} must be 'balanced' or >= 0 (0: off), got {value}")
    return value


def grid_splits(base_splits: int, max_seq_len: int, split_tokens: int, num_seqs: int, num_kv_heads: int,
                sms: int) -> int:
    """The grid's splits per sequence (the rows' grid), never fewer than base_splits, at most
    MAX_SPLITS: with a split size, enough for the longest possible sequence (max_seq_len);
    balanced, as many as keep the grid within DECODE_GRID_PROGRAMS_PER_SM programs per SM (but 2 at
    least) and splits of at least MIN_TOKENS_PER_SPLIT."""
    if split_tokens == 0:
        return base_splits
    if split_tokens > 0:
        return max(base_splits, min(MAX_SPLITS, cdiv(max_seq_len, split_tokens)))
    budget = max(2, min(cdiv(DECODE_GRID_PROGRAMS_PER_SM * sms, max(1, num_seqs * num_kv_heads)),
                        wave_splits(num_kv_heads, sms)))
    return max(base_splits, min(MAX_SPLITS, cdiv(max_seq_len, MIN_TOKENS_PER_SPLIT), budget))


def slot_parts(base_splits: int, max_seq_len: int, num_kv_heads: int, sms: int) -> int:
    """The most splits of one sequence in the slots' grid: one wave of programs (wave_splits), in
    splits of at least MIN_TOKENS_PER_SPLIT, never fewer than base_splits."""
    return max(base_splits, min(MAX_SPLITS, cdiv(max_seq_len, MIN_TOKENS_PER_SPLIT), wave_splits(num_kv_heads, sms)))


def balanced_slots(num_rows: int, num_kv_heads: int, base_splits: int, max_parts: int, share_programs: int) -> int:
    """The slots (per KV head) for every split the kernels' plan can make in the slots' grid. A
    row's parts are at most max(ceil(tiles / chain), base_splits) <= tiles / chain + base_splits,
    and the chain is at least the step's tiles times the KV heads over share_programs, so all rows'
    parts are at most share_programs / KV heads + rows * base_splits; and at most max_parts a row."""
    return min(num_rows * max_parts, cdiv(share_programs, num_kv_heads) + num_rows * base_splits)


def takes_slots(longest_tiles: int, chain: int, base_splits: int, splits: int, max_parts: int, num_rows: int) -> bool:
    """Whether a balanced step runs in the slots' grid (SLOTS): when the rows' grid (`splits` a row)
    leaves the longest sequence's chain longer than the slots' would (max_parts) by more than
    slot_min_gain_tiles() + num_rows / SLOT_ROWS_PER_TILE tiles."""
    wanted = max(cdiv(longest_tiles, chain), base_splits)
    in_rows, in_slots = min(wanted, splits), min(wanted, max_parts)
    gain = cdiv(longest_tiles, in_rows) - cdiv(longest_tiles, in_slots)
    return gain > slot_min_gain_tiles() + num_rows // SLOT_ROWS_PER_TILE


@functools.lru_cache(maxsize=None)
def slot_min_gain_tiles() -> int:
    """SLOT_MIN_GAIN_TILES, or SLOT_GAIN_ENV's whole number of tiles."""
    raw = os.environ.get(SLOT_GAIN_ENV, "").strip()
    if not raw:
        return SLOT_MIN_GAIN_TILES
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{SLOT_GAIN_ENV} must be a whole number of tiles (negative: every balanced step in "
                         f"the slots' grid; 1000000: none), got {raw!r}") from None


def wave_splits(num_kv_heads: int, sms: int) -> int:
    """The most splits that keep one sequence's programs within one wave of DECODE_PROGRAMS_PER_SM per SM."""
    return max(1, DECODE_PROGRAMS_PER_SM * sms // max(1, num_kv_heads))


def device_sms(device: torch.device) -> int:
    """The device's SMs (read once per device); an H200's 132 off CUDA, so that CPU tests plan as it does."""
    return _num_sms(device.index or 0) if device.type == "cuda" else 132


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits per sequence so that the decode grid has about DECODE_PROGRAMS_PER_SM programs per SM
    (one sequence's within one wave: wave_splits).

    A few resident programs per SM keep enough loads in flight to saturate HBM; each split
    keeps at least MIN_TOKENS_PER_SPLIT tokens, so short contexts are not shredded into
    splits whose reduction costs more than it saves.
    """
    programs = max(1, num_seqs * num_kv_heads)
    sms = device_sms(device)
    wanted = min(cdiv(DECODE_PROGRAMS_PER_SM * sms, programs), wave_splits(num_kv_heads, sms))
    most = max(1, cdiv(max_seq_len, MIN_TOKENS_PER_SPLIT))
    return max(1, min(wanted, most, MAX_SPLITS))


def decode_launch(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                  num_splits: int | None = None, split_tokens: int | None = None) -> tuple[int, int, int]:
    """(base splits, the grid's most splits of one sequence, split mode passed to the kernels) of a
    decode launch: the rows' grid's (grid_splits), or for SLOTS the slots' (slot_parts)."""
    base = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, device) if num_splits is None else num_splits
    tokens = decode_split_tokens() if split_tokens is None else split_tokens
    if tokens == SLOTS:
        splits = slot_parts(base, max_seq_len, num_kv_heads, device_sms(device))
    else:
        splits = grid_splits(base, max_seq_len, tokens, num_seqs, num_kv_heads, device_sms(device))
    return base, splits, (tokens if splits > base else 0)


def graph_split_modes(num_rows: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                      block_n: int | None = None, kv_dtype: torch.dtype | None = None) -> list[int]:
    """The split modes a decode CUDA graph of num_rows rows is captured with: the switch's; with
    "balanced" 0, so that a step whose lengths need no cut replays a graph without the plan's extra
    programs, and BALANCED where the rows' grid has room for more splits than the base, and SLOTS
    where some lengths up to max_seq_len can take it (pick_split_mode picks no other). block_n,
    kv_dtype: as pick_split_mode's."""
    mode = decode_split_tokens()
    if mode != BALANCED:
        return [mode]
    base, splits, mode = _balanced_launch(num_rows, num_kv_heads, max_seq_len, device)
    if mode != BALANCED:
        return [0]
    block_n = decode_launch_for(kv_dtype).block_n if block_n is None else block_n
    most = slot_parts(base, max_seq_len, num_kv_heads, device_sms(device))
    return [0, BALANCED] + ([SLOTS] if _slots_can_gain(cdiv(max_seq_len, block_n), splits, most, num_rows) else [])


def _slots_can_gain(max_tiles: int, splits: int, max_parts: int, num_rows: int) -> bool:
    """Whether takes_slots can hold for a step whose longest sequence has at most max_tiles tiles:
    its gain is largest where the cut asks for max_parts or more (rows' chains cdiv(t, splits),
    slots' cdiv(t, max_parts)), so no step gains more than the most of that over t. At
    max_model_len 4,096 and 8 KV heads no size can (64 rows: 3 splits against 16, at most 9 tiles
    against the 12 asked), so a short-context server captures no SLOTS graph."""
    if max_parts <= splits:
        return False
    t = np.arange(1, max_tiles + 1)
    best = int((-(-t // splits) - -(-t // max_parts)).max())
    return best > slot_min_gain_tiles() + num_rows // SLOT_ROWS_PER_TILE


def pick_split_mode(seq_lens: Sequence[int], num_rows: int, num_kv_heads: int, max_seq_len: int,
                    device: torch.device, block_n: int | None = None, kv_dtype: torch.dtype | None = None) -> int:
    """SLOTS, BALANCED or 0 for a balanced launch over num_rows rows: the first len(seq_lens) hold
    these lengths, the rest are padding of length 1. SLOTS where the slots' grid shortens the
    longest chain of tiles enough against the rows' (takes_slots); else BALANCED where the plan the
    kernels derive (triton_decode's balanced_chain_tiles and _balanced_parts, mirrored here from the
    same lengths) shortens it by more than BALANCED_MIN_GAIN_TILES; else 0: the same cuts the batch
    size asks for, without the plan's extra programs and reduction. block_n: default the launch's
    over a cache of kv_dtype (decode_launch_for)."""
    base, splits, mode = _balanced_launch(num_rows, num_kv_heads, max_seq_len, device)
    if mode != BALANCED or not len(seq_lens):
        return 0
    block_n = decode_launch_for(kv_dtype).block_n if block_n is None else block_n
    tiles = -(-np.asarray(seq_lens, dtype=np.int64) // block_n)
    work = (int(tiles.sum()) + num_rows - len(tiles)) * num_kv_heads
    share, min_chain = balanced_share(device, block_n)
    chain = max(-(-work // share), min_chain)
    longest = int(tiles.max())
    most = slot_parts(base, max_seq_len, num_kv_heads, device_sms(device))
    if takes_slots(longest, chain, base, splits, most, num_rows):
        return SLOTS  # its gain over the rows' grid is past 2 tiles, so past the base's too
    parts = min(max(-(-longest // chain), base), splits)
    return BALANCED if -(-longest // base) - -(-longest // parts) > BALANCED_MIN_GAIN_TILES else 0


@functools.lru_cache(maxsize=None)
def decode_share_per_sm() -> int:
    """The balanced plan's programs per SM: DECODE_SHARE_PROGRAMS_PER_SM, or DECODE_SHARE_ENV's."""
    raw = os.environ.get(DECODE_SHARE_ENV, "").strip()
    if not raw:
        return DECODE_SHARE_PROGRAMS_PER_SM
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{DECODE_SHARE_ENV} must be a whole number of programs per SM >= 1, got {raw!r}")
    return int(raw)


def balanced_share(device: torch.device, block_n: int) -> tuple[int, int]:
    """The balanced plan's defaults: (programs the step's work is shared over, fewest tiles a
    chain is cut to), as the kernels get them (SHARE_PROGRAMS, MIN_CHAIN_TILES)."""
    return decode_share_per_sm() * device_sms(device), max(1, MIN_TOKENS_PER_SPLIT // block_n)


@functools.lru_cache(maxsize=4096)
def _balanced_launch(num_rows: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> tuple[int, int, int]:
    return decode_launch(num_rows, num_kv_heads, max_seq_len, device, split_tokens=BALANCED)


# The SLOTS reduce's splits at a time (triton_decode.reduce_splits_kernel): more come in further
# passes, so that a row of a few splits reads only those while a long one may have a wave. The
# rows' grids reduce all of a row's splits in one block.
REDUCE_BLOCK_S = 16


def reduce_block(splits: int, mode: int = 0) -> int:
    """The reduce's BLOCK_S for a launch of split mode `mode` whose sequences have at most `splits`
    splits."""
    return min(next_power_of_2(splits), REDUCE_BLOCK_S) if mode == SLOTS else next_power_of_2(splits)


def decode_compile_key(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> tuple[int, int]:
    """What a decode launch compiles per outside a decode graph (runner/warmup.py covers each; a
    graph's capture compiles its own): the reduction's split block (1: no reduction, the kernel
    writes the output) and the split mode."""
    _, splits, mode = decode_launch(num_seqs, num_kv_heads, max_seq_len, device)
    return (reduce_block(splits, mode) if splits > 1 else 1), mode
