"""Piecewise CUDA graphs for steps that carry prefill tokens, one set per token-count bucket.

Why: a step with prefill tokens has a token count that changes every step and an attention whose
launch grid depends on the sequences' lengths, so it cannot be one graph the way a decode step
is (runner/cuda_graph.py). Run eagerly, a Llama-8B step is ~32 layers x ~15 launches from Python
and the GPU waits for the host. Everything except attention only depends on the token count, so
it is captured per bucket; attention runs eagerly between the pieces (vLLM's "piecewise" mode).

How: the forward of bucket T is captured as num_layers + 1 graphs ("pieces") split at every
attention call. While capturing, `attention_boundary` diverts Attention.forward to a hook that
 1. rotates the layer's q and k and writes its k, v into the KV pools at the slots of a static
    slot-mapping buffer (Attention.rotate_and_store: its launch depends only on the row count),
    then copies q into a static buffer, all inside the current piece, so every replay does them too,
 2. ends the current piece and begins the next one,
 3. returns the static attention-output buffer, which the next piece reads.
The last piece copies the final hidden states into a static buffer. Replay of a step with n <= T
tokens: copy input ids, positions and slot mapping into the first n rows of static buffers (slot
-1 in rows n..T), replay piece 0, run attention i eagerly on the first n rows of q with the step's
real metadata over the pools piece i has written, straight into the output buffer, replay
piece i + 1, and so on. Padded rows (n..T) hold the stale, always-valid ids and positions of earlier
steps; every op outside attention treats rows independently, their slot -1 writes nothing, and
attention never reads them, so they do not disturb the real rows. (The K/V write sat with the
eager attention before: one Triton launch from Python per layer and step, and two copies; and
attention's output was copied into the buffer, a third.)

Memory: one pool for every piece of every bucket (the decode graphs' pool when given), largest
bucket first. Nothing captured stays referenced across buckets: whatever crosses a piece boundary
(residual stream, rotary cos/sin) is only held while its bucket is captured, and the tensors eager
code touches (ids, positions, slot mapping, q, attention output, hidden states) are static buffers outside
the pool, sized for the largest bucket and shared by all buckets and layers. Sharing is sound
because steps replay one at a time on one stream.

Only Llama-family models (models/llama.py: Llama, Mistral, Qwen2, Qwen3, and the mixtures of
experts of models/moe.py built on them) qualify: their layers all have the same attention shapes
and nothing but Attention reads the metadata (the MoE layers' routing and sort stay on the device). Others (OPT)
run prefill steps eagerly. The graph type is a parameter so that CPU tests can substitute a
recorder with the same capture_begin / capture_end / replay / pool surface.
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable, Protocol

import torch
from torch import nn

from pagedserve.attention.backend import Attention, attention_boundary
from pagedserve.attention.metadata import AttentionMetadata

# Above ~1k tokens the GPU work of a step (~15 ms for an 8B model) outlasts the host's launches, so
# eager costs nothing there, and padding up to a coarse bucket would only add work. On a slow host
# that does not hold (the H200 serving run at ba7b152, 10 req/s: a 1,042-token step took 40 ms
# eagerly, piecewise steps of 769-1,024 tokens 23.5 ms): PAGEDSERVE_PIECEWISE_MAX_TOKENS raises the
# cap for an A/B (buckets above 1,024 as the full graphs': every 256 to 2,048, 512 to 4,096, ...).
MAX_PIECEWISE_TOKENS = 1024
PIECEWISE_MAX_TOKENS_ENV = "PAGEDSERVE_PIECEWISE_MAX_TOKENS"


def piecewise_max_tokens() -> int:
    """PAGEDSERVE_PIECEWISE_MAX_TOKENS: the largest piecewise bucket (default MAX_PIECEWISE_TOKENS)."""
    text = os.environ.get(PIECEWISE_MAX_TOKENS_ENV, "").strip()
    if not text:
        return MAX_PIECEWISE_TOKENS
    if not text.isdigit() or not 16 <= int(text) <= 8192:
        raise ValueError(f"{PIECEWISE_MAX_TOKENS_ENV} must be an integer from 16 to 8192, got {text!r}")
    return int(text)


class GraphLike(Protocol):
    def capture_begin(self, pool=None) -> None: ...
    def capture_end(self) -> None: ...
    def replay(self) -> None: ...
    def pool(self): ...


def token_buckets(max_tokens: int, cap: int = MAX_PIECEWISE_TOKENS) -> list[int]:
    """Token counts to capture: every 16 up to 256, every 32 up to 512, every 128 up to 1024, then
    every 256 up to 2048, 512 up to 4096 and 1024 up to 8192; capped at min(max_tokens, cap) (and
    including it). Up to 1,024: at most 28 buckets (28 x (layers + 1) graphs: 924 for a 32-layer
    model); padding adds under 16 rows up to 256 tokens, under 32 up to 512, and under 25% of a step
    above that, where the step's GPU time already hides most of its launches."""
    top = min(max_tokens, cap)
    sizes = list(range(16, 257, 16)) + list(range(288, 513, 32)) + list(range(640, 1025, 128)) + \
        list(range(1280, 2049, 256)) + list(range(2560, 4097, 512)) + list(range(5120, 8193, 1024))
    return sorted({s for s in sizes if s <= top} | {top}) if top >= 1 else []


def supports_piecewise(model: nn.Module) -> bool:
    from pagedserve.models.llama import LlamaForCausalLM
    return isinstance(model, LlamaForCausalLM)


class PiecewiseCUDAGraphs:
    def __init__(self, model: nn.Module, kv_caches, max_tokens: int, device: torch.device,
                 pool=None, graph_factory: Callable[[], GraphLike] | None = None):
        attn = [m for m in model.modules() if isinstance(m, Attention)]
        if not attn:
            raise ValueError("piecewise graphs need a model with Attention layers")
        widths = {(a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim) for a in attn}
        if len(widths) != 1:
            raise ValueError(f"piecewise graphs need one attention shape in every layer, got {sorted(widths)}")
        (q_width, _), = widths
        self.model, self.kv_caches, self.device = model, kv_caches, torch.device(device)
        self.graph_factory = graph_factory or torch.cuda.CUDAGraph
        self.pool = pool
        self.buckets = token_buckets(max_tokens, piecewise_max_tokens())
        if not self.buckets:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        n = self.buckets[-1]
        dtype = next(model.parameters()).dtype
        hidden = model.config.hidden_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(n, dtype=torch.long, device=self.device)
        self.q = torch.zeros(n, q_width, dtype=dtype, device=self.device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=self.device)
        self.attn_out = torch.zeros(n, q_width, dtype=dtype, device=self.device)
        self.hidden = torch.zeros(n, hidden, dtype=dtype, device=self.device)
        self.pieces: dict[int, list[GraphLike]] = {}
        # (module, k_cache, v_cache) of each attention call, in forward order (the same for every bucket).
        self.layers: list[tuple[Attention, torch.Tensor, torch.Tensor]] = []

    @property
    def num_graphs(self) -> int:
        return sum(len(p) for p in self.pieces.values())

    def bucket_for(self, num_tokens: int) -> int | None:
        for b in self.buckets:
            if b >= num_tokens:
                return b
        return None

    # --- capture ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        cuda = self.device.type == "cuda"
        self.slot_mapping.fill_(-1)  # the capture runs execute too: they must write no K/V
        stream = torch.cuda.Stream(self.device) if cuda else None
        if cuda:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            for t in reversed(self.buckets):  # largest first: smaller buckets fit in its pool memory
                self._run_split(t, capture=False)  # warm-up: lazy init and autotuning stay out of the graphs
                if cuda:
                    torch.cuda.synchronize(self.device)
                self.pieces[t] = self._run_split(t, capture=True)
        if cuda:
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)

    def _run_split(self, t: int, capture: bool) -> list[GraphLike]:
        """One forward of bucket t with attention replaced by the boundary hook; with capture, each
        stretch between two attention calls becomes one graph of the shared pool."""
        pieces: list[GraphLike] = []
        layers: list[tuple[Attention, torch.Tensor, torch.Tensor]] = []

        def begin() -> None:
            graph = self.graph_factory()
            graph.capture_begin(pool=self.pool)
            pieces.append(graph)

        def end() -> None:
            pieces[-1].capture_end()
            if self.pool is None:
                self.pool = pieces[-1].pool()

        def boundary(attn, q, k, v, k_cache, v_cache, meta, rope=None) -> torch.Tensor:
            # Every slot is -1 while capturing (run() sets them per step): nothing is written now.
            q = attn.rotate_and_store(q, k, v, k_cache, v_cache, self.slot_mapping[:t], rope)
            self.q[:t].view(q.shape).copy_(q)
            layers.append((attn, k_cache, v_cache))
            if capture:
                end()
                begin()
            return self.attn_out[:t]

        with attention_boundary(boundary):
            if capture:
                begin()
            # The metadata is never read: Llama passes it only to Attention, which the hook replaces.
            hidden = self.model(self.input_ids[:t], self.positions[:t], self.kv_caches, None)
            self.hidden[:t].copy_(hidden)
            del hidden
            if capture:
                end()
        if self.layers and [(id(a), kc.data_ptr()) for a, kc, _ in layers] != \
                [(id(a), kc.data_ptr()) for a, kc, _ in self.layers]:
            raise RuntimeError("the model called its attention layers in a different order for another bucket")
        self.layers = layers
        return pieces

    # --- replay -------------------------------------------------------------------------------------------
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states [num_tokens, hidden] of the step (a view of a static buffer, valid until
        the next run); num_tokens must fit a bucket (bucket_for is not None)."""
        n = input_ids.shape[0]
        t = self.bucket_for(n)
        if t is None:
            raise ValueError(f"{n} tokens exceed the largest piecewise bucket ({self.buckets[-1]})")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[n:t].fill_(-1)  # (the rows of a larger step before)
        pieces = self.pieces[t]
        q, out = self.q[:n], self.attn_out[:n]
        for piece, (attn, k_cache, v_cache) in zip(pieces, self.layers):
            piece.replay()
            attn.attend_stored(q, k_cache, v_cache, meta, out=out)
        pieces[-1].replay()
        return self.hidden[:n]
