"""A decode step as two nano-batches, each one's attention on a second stream beside the other's matmuls.

At a thousand decodes of Llama-3.1-8B a step is ~60% GEMMs (compute-bound) and ~30% attention
(memory-bound), one after the other in every layer, so neither the tensor cores nor HBM are busy
the whole step (docs/benchmarks.md: the serial bound). NanoFlow (Zhu et al., OSDI 2025) splits the
batch in two and overlaps one half's attention with the other half's matmuls. Here, per layer i,
with halves A and B (rows [:h] and [h:]):

    main stream:  A.before(i)  B.before(i)  A.after(i)  A.before(i+1)  B.after(i)  B.before(i+1) ...
    side stream:        A.attn(i)     B.attn(i)              A.attn(i+1)               B.attn(i+1)

so A's attention runs beside B's projections, B's beside A's o_proj and MLP, A's next beside B's
o_proj and MLP. `before` is the input norm and qkv projection; `after` is o_proj, the
post-attention norm and the MLP (LlamaDecoderLayer.before_attention / after_attention); `attn`
rotates the half's q and k (in place), writes its K/V and attends over its pages. The rows of one sequence never straddle a
dependency the wrong way: a short prefill replayed as decode rows (runner/decode_rows.py) puts a
sequence's rows in order, and A's attention of a layer precedes B's on the side stream.

Memory across streams: q, k, v are made on the main stream and read (q and k rotated in place) on
the side one, as are the step's cos/sin (held by the halves to the end), so they are held until the main stream has waited for that attention (then a later main allocation that
reuses their memory is ordered after the read); the attention's output is made on the side
stream and every side launch waits for the main stream first, so the side reuses it only after
the main stream's o_proj read it. Within a CUDA graph capture the same events become edges.

On a CPU (no streams) the same order runs on one stream: the tests check it against forward.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.models.llama import LlamaModel

NANO_PRIORITY_ENV = "PAGEDSERVE_NANO_PRIORITY"


def supports_nano_batches(model) -> bool:
    """Whether model's decoder is the Llama family's (LlamaModel: the layers have
    before_attention / after_attention)."""
    return isinstance(getattr(model, "model", None), LlamaModel)


def check_nano_batches(config, model, tp_size: int, device: torch.device) -> None:
    """A one-line ValueError where config.nano_batch_rows cannot run: a model outside the Llama
    family, tensor parallelism, or a carveout of every SM."""
    if not config.nano_batch_rows:
        return
    if not supports_nano_batches(model):
        raise ValueError(f"nano_batch_rows needs a Llama-family model; {type(model).__name__} has no "
                         "nano-batch forward")
    if tp_size > 1:
        raise ValueError("nano_batch_rows is not supported with tensor_parallel_size > 1 yet")
    if device.type == "cuda" and config.nano_batch_sm_carveout:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if config.nano_batch_sm_carveout >= sms:
            raise ValueError(f"nano_batch_sm_carveout must be below the device's {sms} SMs, "
                             f"got {config.nano_batch_sm_carveout}")


@contextmanager
def matmul_sm_carveout(sms: int) -> Iterator[None]:
    """Within the block cuBLAS(Lt) matmuls target all SMs but `sms` (torch's experimental SM
    carveout; 0: unchanged), so the attention beside them finds SMs free; a CUDA graph captured
    inside keeps the count."""
    if not sms:
        yield
        return
    before = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(before)


def split_decode_meta(meta: AttentionMetadata, h: int) -> tuple[AttentionMetadata, AttentionMetadata]:
    """Two decode-only metadata for rows [:h] and [h:] of a decode-only step's (every row one query
    token, so query_start_loc is 0, 1, ..., n and either half's is its first rows + 1)."""
    n = meta.num_seqs
    if meta.num_decodes != n or not 0 < h < n:
        raise ValueError(f"split_decode_meta: a decode-only step of n >= 2 rows split at 0 < h < n "
                         f"(n={n}, num_decodes={meta.num_decodes}, h={h})")
    lens = meta.seq_lens_cpu

    def half(rows: slice, count: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=meta.slot_mapping[rows], query_start_loc=meta.query_start_loc[:count + 1],
            seq_lens=meta.seq_lens[rows], block_tables=meta.block_tables[rows], num_decodes=count,
            max_query_len=1, max_seq_len=meta.max_seq_len, block_size=meta.block_size,
            query_lens_cpu=None if meta.query_lens_cpu is None else meta.query_lens_cpu[rows],
            seq_lens_cpu=None if lens is None else lens[rows], decode_split_tokens=meta.decode_split_tokens)
    return half(slice(0, h), h), half(slice(h, n), n - h)


@dataclass
class _Half:
    """One nano-batch between layers: its hidden state and residual stream, and its attention in flight."""
    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    meta: AttentionMetadata
    residual: torch.Tensor | None = None
    held: tuple = ()  # q, k, v of the attention in flight on the side stream
    done: object = None  # the side stream's event after that attention
    out: torch.Tensor | None = None  # that attention's output


def forward_in_halves(model, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata,
                      streams: "NanoStreams | None" = None, sm_carveout: int = 0) -> torch.Tensor:
    """forward_nano_batches over a decode-only step's rows split at half_rows(n), the matmuls leaving
    sm_carveout SMs free where there are streams (CUDA): the runner's and the decode graphs' call."""
    with matmul_sm_carveout(sm_carveout if streams is not None else 0):
        return forward_nano_batches(model, input_ids, positions, kv_caches,
                                    split_decode_meta(meta, half_rows(meta.num_seqs)), streams)


def half_rows(n: int) -> int:
    """Where a step of n >= 2 rows splits: n // 2 rounded down to even (one row below 4 rows). The
    second half's int64 rows (its slot_mapping) then start 16-byte aligned, as the warm-up's halves
    of its even bucket sizes do: Triton compiles a kernel again for a pointer of another alignment,
    and eager steps of odd halves met one after start-up (the H200 warm-up test, rope_write_kv's).
    A one-row half (n of 2 or 3) is the warm-up's two-row step's where nano_batch_rows is 2."""
    return 1 if n < 4 else (n // 2) & ~1


class NanoStreams:
    """The CUDA streams of nano-batched steps: `side` for the attention and, where the other work
    has the priority, `main` for that (else it runs on the caller's stream).

    Which stream goes first matters where both have blocks waiting for an SM: the one whose work is
    shorter should (its results are what the other waits for, and it fills the other's gaps). At
    fixed256's thousand decodes of Llama-3.1-8B the attention is the shorter (~30% of a step against
    ~60% matmuls); at nanovllm's Qwen3-0.6B it is the longer (75%). PAGEDSERVE_NANO_PRIORITY: side
    (the default), main, or equal (both at the default priority)."""

    def __init__(self, device: torch.device):
        first = nano_priority()
        self.side = torch.cuda.Stream(device, priority=-1 if first == "side" else 0)
        self.main = torch.cuda.Stream(device, priority=-1) if first == "main" else None

    @classmethod
    def for_engine(cls, config, device: torch.device) -> "NanoStreams | None":
        """The streams config.nano_batch_rows asks for on `device`; None when off or not CUDA."""
        return cls(device) if config.nano_batch_rows and device.type == "cuda" else None


def nano_priority() -> str:
    mode = os.environ.get(NANO_PRIORITY_ENV, "side").strip().lower()
    if mode not in ("side", "main", "equal"):
        raise ValueError(f"{NANO_PRIORITY_ENV} must be side, main or equal, got {mode!r}")
    return mode


def forward_nano_batches(model, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches,
                         metas: tuple[AttentionMetadata, AttentionMetadata],
                         streams: NanoStreams | None = None) -> torch.Tensor:
    """model.forward's hidden states [n, hidden] for a decode-only step, computed as two
    nano-batches (metas: split_decode_meta's, rows [:h] then [h:]), attention on streams.side
    (None: the same order on the current stream)."""
    if streams is None or streams.main is None:
        return _pipeline(model, input_ids, positions, kv_caches, metas, streams and streams.side)
    caller = torch.cuda.current_stream()
    streams.main.wait_stream(caller)
    with torch.cuda.stream(streams.main):
        hidden = _pipeline(model, input_ids, positions, kv_caches, metas, streams.side)
    caller.wait_stream(streams.main)
    if not torch.cuda.is_current_stream_capturing():
        hidden.record_stream(caller)  # made on streams.main, read and freed on the caller's
    return hidden


def _pipeline(model, input_ids, positions, kv_caches, metas, side) -> torch.Tensor:
    body = model.model
    h = metas[0].num_seqs
    x = body.embed(input_ids)
    cos, sin = body.rotary_emb(positions, x.dtype)
    halves = [_Half(x[:h], cos[:h], sin[:h], metas[0]), _Half(x[h:], cos[h:], sin[h:], metas[1])]
    main = torch.cuda.current_stream() if side is not None else None
    layers = list(zip(body.layers, kv_caches))

    def start(half: _Half, i: int) -> None:
        layer, kv = layers[i]
        q, k, v, half.residual = layer.before_attention(half.x, half.residual)
        half.held = (q, k, v)
        rope = layer.self_attn.rope(half.cos, half.sin)
        if side is None:
            half.out = layer.self_attn.attn(q, k, v, kv[0], kv[1], half.meta, rope)
            return
        side.wait_stream(main)
        with torch.cuda.stream(side):
            half.out = layer.self_attn.attn(q, k, v, kv[0], kv[1], half.meta, rope)
            half.done = torch.cuda.Event()
            half.done.record(side)

    def finish(half: _Half, i: int) -> None:
        if half.done is not None:
            main.wait_event(half.done)
        half.x, half.residual = layers[i][0].after_attention(half.out, half.residual)
        half.held, half.out, half.done = (), None, None

    a, b = halves
    start(a, 0)
    start(b, 0)
    for i in range(len(layers)):
        finish(a, i)
        if i + 1 < len(layers):
            start(a, i + 1)
        finish(b, i)
        if i + 1 < len(layers):
            start(b, i + 1)
    return torch.cat([body.norm(half.x, half.residual)[0] for half in halves])
