"""The one attention interface every model uses, and the choice of kernels behind it.

Attention.forward rotates this step's q and k by the layer's Rope (when it hands one over) and
writes its K/V into the paged pools through meta.slot_mapping (on CUDA one Triton launch does
both: triton_cache.rope_write_kv), then attends each sequence's new queries over its whole context
read through meta.block_tables. On CUDA the Triton kernels are used
(pagedserve.attention.triton_ops, imported lazily); on CPU, or when they are missing,
the plain-torch reference. Both expose the same three functions:
write_kv, paged_attention, copy_blocks. The Triton one also carries its decode launch plan
(triton_ops.decode_plan, attention/decode_plan.py), which the runner reads for its decode graphs'
split modes and the warm-up's compile keys; the reference has none.
"""
from __future__ import annotations

import importlib
import logging
import os
from contextlib import contextmanager
from contextvars import ContextVar
from types import ModuleType
from typing import Callable, Iterator

import torch
from torch import nn

from pagedserve.attention import reference
from pagedserve.attention.kv_quant import FP8_KV_DTYPE, calibration_scale
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.layers.fused import fused_ops
from pagedserve.layers.rotary import Rope

logger = logging.getLogger(__name__)
_BACKENDS: dict[str, ModuleType] = {}
# Set only while runner/piecewise_graphs.py captures a forward: every Attention call goes to the
# hook instead (a ContextVar, so a forward on another thread is never diverted).
_BOUNDARY_HOOK: ContextVar[Callable | None] = ContextVar("attention_boundary_hook", default=None)


# "0": rotate q/k and write K/V in two launches, as before the one-launch kernel (an A/B switch).
ROPE_STORE_ENV = "PAGEDSERVE_ROPE_STORE"


@contextmanager
def attention_boundary(hook: Callable) -> Iterator[None]:
    """Within the block, Attention.forward(q, k, v, k_cache, v_cache, meta, rope) returns
    hook(module, q, k, v, k_cache, v_cache, meta, rope) and runs no attention itself."""
    token = _BOUNDARY_HOOK.set(hook)
    try:
        yield
    finally:
        _BOUNDARY_HOOK.reset(token)


def get_backend(device: torch.device | str) -> ModuleType:
    """The kernel module for tensors on `device` (PAGEDSERVE_ATTENTION=reference forces plain torch)."""
    kind = torch.device(device).type
    if kind not in _BACKENDS:
        mod: ModuleType = reference
        if kind == "cuda" and os.environ.get("PAGEDSERVE_ATTENTION", "") != "reference":
            try:
                mod = importlib.import_module("pagedserve.attention.triton_ops")
            except ImportError as e:
                logger.warning("Triton attention unavailable (%s); using the plain-torch reference", e)
        _BACKENDS[kind] = mod
    return _BACKENDS[kind]


def choices() -> dict[str, str]:
    """The kernel module each device type got so far in this process (for result files)."""
    return {kind: mod.__name__.rsplit(".", 1)[-1] for kind, mod in _BACKENDS.items()}


class Attention(nn.Module):
    """Paged multi-head / grouped-query attention over one layer's K/V pools.

    k_scale / v_scale: this layer's FP8 KV-cache scales (attention/kv_quant.py), float32 on the
    device, both [1] (per tensor) or both [num_kv_heads] (per KV head: this rank's heads, which
    are heads kv_head_start .. kv_head_start + num_kv_heads - 1 of the checkpoint's
    total_num_kv_heads); read only when the pools are fp8. Device tensors, not Python floats, so a
    CUDA graph captured before they change still reads the new values (their shape is settled by
    loading and calibration, both before any capture). calibrating: while True, every forward
    raises them to fit the K/V it sees (calibrate_kv_scales). sliding_window: each token attends to
    its last sliding_window positions, itself included (HF's sliding-window mask); 0: all of them.
    Every block stays in the pools (none is freed past the window). logit_softcap > 0: the scores
    (after the scale) become logit_softcap * tanh(score / logit_softcap) (Gemma 2's)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 total_num_kv_heads: int | None = None, kv_head_start: int = 0, sliding_window: int = 0,
                 logit_softcap: float = 0.0):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.total_num_kv_heads = num_kv_heads if total_num_kv_heads is None else total_num_kv_heads
        self.kv_head_start = kv_head_start
        if sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0 (0: none), got {sliding_window}")
        self.sliding_window = sliding_window
        if logit_softcap < 0:
            raise ValueError(f"logit_softcap must be >= 0 (0: none), got {logit_softcap}")
        self.logit_softcap = float(logit_softcap)
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.calibrating = False

    @property
    def kv_scale_per_head(self) -> bool:
        return self.k_scale.numel() > 1

    def set_kv_scale_per_head(self, per_head: bool) -> None:
        """Reshape both scales to [num_kv_heads] (each head starts from the shared value) or to [1]
        (the largest head's value, so no head's values saturate)."""
        if per_head == self.kv_scale_per_head:
            return
        for name in ("k_scale", "v_scale"):
            old = getattr(self, name)
            new = old.expand(self.num_kv_heads).clone() if per_head else old.max().reshape(1)
            setattr(self, name, new)  # a registered buffer: replaced, still a buffer

    def load_kv_scale(self, kind: str, value: torch.Tensor) -> None:
        """A checkpoint's k_scale / v_scale (kind "k" or "v"): one number (per tensor; a per-head
        layer gets it in every head) or one per KV head of the whole model ([H], or [H, 1, 1] as
        llm-compressor writes its "attn_head" strategy), of which this rank keeps its own heads."""
        value = value.float().reshape(-1)
        if value.numel() == 1:
            getattr(self, f"{kind}_scale").fill_(value.item())
            return
        if value.numel() != self.total_num_kv_heads:
            raise ValueError(f"a KV-cache scale must be per tensor (one number) or per KV head "
                             f"({self.total_num_kv_heads} numbers), got {value.numel()}")
        self.set_kv_scale_per_head(True)
        mine = value[self.kv_head_start:self.kv_head_start + self.num_kv_heads]
        getattr(self, f"{kind}_scale").copy_(mine)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, rope: Rope | None = None) -> torch.Tensor:
        """q: [T, num_heads * head_dim] (or [T, H, D]); k, v likewise with num_kv_heads; rope: the
        layer's rotary, still to be applied to q and k (None: none, or applied already).

        Returns [T, num_heads * head_dim].
        """
        hook = _BOUNDARY_HOOK.get()
        if hook is not None:
            return hook(self, q, k, v, k_cache, v_cache, meta, rope)
        return self.attend(q, k, v, k_cache, v_cache, meta, rope)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata, rope: Rope | None = None) -> torch.Tensor:
        """The attention itself (forward without the boundary hook): rotate_and_store, then attend_stored."""
        T = q.shape[0]
        if self.calibrating and T:
            k3 = k.view(T, self.num_kv_heads, self.head_dim)
            v3 = v.view(T, self.num_kv_heads, self.head_dim)
            if rope is not None:  # the scales are the rotated K's
                q, k3 = rope.apply(q.view(T, self.num_heads, self.head_dim), k3)
                k, rope = k3, None
            # per head: the amax over tokens and head_dim, one per KV head; else over everything
            dims = (0, 2) if self.kv_scale_per_head else (0, 1, 2)
            self.k_scale.copy_(torch.maximum(self.k_scale, calibration_scale(k3.abs().amax(dim=dims))))
            self.v_scale.copy_(torch.maximum(self.v_scale, calibration_scale(v3.abs().amax(dim=dims))))
        q = self.rotate_and_store(q, k, v, k_cache, v_cache, meta.slot_mapping, rope)
        return self.attend_stored(q, k_cache, v_cache, meta)

    def rotate_and_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor, rope: Rope | None = None) -> torch.Tensor:
        """Rotate q and k by rope (None: nothing to rotate), then store_kv; returns q [T, H, D].
        On CUDA one launch does it all in place (triton_cache.rope_write_kv: no second read of k and
        v, one kernel a layer less; an fp8 pool quantized as store_kv does); else rotate_qk, then
        store_kv. Its launch depends only on T."""
        T = q.shape[0]
        q3, k3 = q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim)
        if rope is not None:
            one_launch = self._rope_write_kv(q3, k3, k_cache, rope)
            if one_launch is not None:
                one_launch(q3, k3, v.view(T, self.num_kv_heads, self.head_dim), rope.cos, rope.sin, k_cache, v_cache,
                           slot_mapping, **rope.norm_weights(), k_scale=self.k_scale, v_scale=self.v_scale)
                return q3
            q3, k3 = rope.apply(q3, k3)
        self.store_kv(k3, v, k_cache, v_cache, slot_mapping)
        return q3

    @staticmethod
    def _rope_write_kv(q: torch.Tensor, k: torch.Tensor, k_cache: torch.Tensor, rope: Rope) -> Callable | None:
        """The backend's one-launch rotary and K/V write where it applies: the Triton attention and
        layer ops (CUDA), a pool of the activations' dtype or fp8, norm weights of the activations'
        dtype, not switched off (calibrating KV scales never gets here: attend rotates first)."""
        if os.environ.get(ROPE_STORE_ENV, "1") == "0" or fused_ops(q.device) is None or \
                k_cache.dtype not in (k.dtype, FP8_KV_DTYPE):
            return None
        if rope.q_norm is not None and not rope.q_norm.weight.dtype == q.dtype == k.dtype:
            return None
        return getattr(get_backend(q.device), "rope_write_kv", None)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Write the step's new K/V ([T, num_kv_heads * head_dim] or [T, num_kv_heads, head_dim])
        into the pools at slot_mapping (slot -1: not written). Its launch depends only on T, so
        piecewise graphs capture it inside their pieces."""
        T = k.shape[0]
        get_backend(k.device).write_kv(k.view(T, self.num_kv_heads, self.head_dim),
                                       v.view(T, self.num_kv_heads, self.head_dim), k_cache, v_cache,
                                       slot_mapping, self.k_scale, self.v_scale)

    def attend_stored(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q over the pools, once store_kv has written the step's K/V there; into
        `out` ([T, num_heads * head_dim], contiguous) when given."""
        T, H, D = q.shape[0], self.num_heads, self.head_dim
        o = get_backend(q.device).paged_attention(q.view(T, H, D), k_cache, v_cache, meta, self.scale,
                                                  k_scale=self.k_scale, v_scale=self.v_scale,
                                                  out=None if out is None else out.view(T, H, D),
                                                  window=self.sliding_window, softcap=self.logit_softcap)
        return o.reshape(T, H * D)


@contextmanager
def calibrate_kv_scales(model: nn.Module, per_head: bool = False) -> Iterator[None]:
    """Forwards inside the block set every layer's K/V scales from the K/V they produce (the
    largest seen, with kv_quant's headroom), starting from zero: calculate_kv_scales' warm-up
    and the accuracy script's calibration on real text. per_head: one scale per KV head, from
    that head's amax (kv_cache_scale_strategy "attn_head"); else one per layer (vLLM's)."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for m in layers:
        m.set_kv_scale_per_head(per_head)
        m.k_scale.zero_()
        m.v_scale.zero_()
        m.calibrating = True
    try:
        yield
    finally:
        for m in layers:
            m.calibrating = False
            for s in (m.k_scale, m.v_scale):  # a layer (head) no forward reached keeps 1.0
                s.masked_fill_(s == 0.0, 1.0)
