"""Triton kernels that move K/V inside the block pools: slot writes (alone, or with the rotary
that makes K), and block copies; and their launches (write_kv, rope_write_kv, copy_blocks: the
Triton backend's, which triton_ops exports), with the pool checks and FP8 scale arguments that
triton_ops' attention launches share (check_pool_layout, fp8_scale_args).

Pools are [num_blocks, block_size, num_kv_heads, head_dim]; a block is one contiguous
run of block_size * num_kv_heads * head_dim elements, which is what copy_blocks relies on.
"""
import torch
import triton
import triton.language as tl

from pagedserve.attention.kv_quant import is_fp8
from pagedserve.host_math import cdiv, next_power_of_2
from pagedserve.layers.triton_fused import QK_ROPE_HEADS, norm_rope_heads, pool_value


@triton.jit
def write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    k_scale_ptr=None, v_scale_ptr=None, KV_FP8: tl.constexpr = False, KV_SCALE_PER_HEAD: tl.constexpr = False,
):
    """One program per new token: copy its [num_kv_heads, head_dim] K and V into its slot; into an
    fp8 pool as x / scale, saturated to +-448 and rounded to nearest even (kv_quant.quantize_kv).
    KV_SCALE_PER_HEAD: the scales are [num_kv_heads], each row divided by its head's."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    dst = block * stride_cb + offset * stride_cs + h * stride_ch + d
    k = tl.load(key_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask)
    if KV_FP8:
        # div_rn: IEEE division, as torch divides (Triton's "/" is an approximate one on the GPU), so
        # the stored bytes are torch's (kv_quant.quantize_kv) bit for bit.
        if KV_SCALE_PER_HEAD:
            # One scale per head row, broadcast over head_dim (div_rn itself does not broadcast).
            ks = tl.broadcast_to(tl.load(k_scale_ptr + h, mask=h < NUM_KV_HEADS, other=1.0), (BLOCK_H, BLOCK_D))
            vs = tl.broadcast_to(tl.load(v_scale_ptr + h, mask=h < NUM_KV_HEADS, other=1.0), (BLOCK_H, BLOCK_D))
            k = tl.clamp(tl.math.div_rn(k.to(tl.float32), ks), -448.0, 448.0)
            v = tl.clamp(tl.math.div_rn(v.to(tl.float32), vs), -448.0, 448.0)
        else:
            k = tl.clamp(tl.math.div_rn(k.to(tl.float32), tl.load(k_scale_ptr)), -448.0, 448.0)
            v = tl.clamp(tl.math.div_rn(v.to(tl.float32), tl.load(v_scale_ptr)), -448.0, 448.0)
        k = k.to(k_cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        v = v.to(v_cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# A one-token step may give cos/sin a size-1 leading dim with any stride: do not compile per value.
@triton.jit(do_not_specialize=["cos_stride", "sin_stride"])
def rope_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h, cos_stride, sin_stride,
    stride_cb, stride_cs, stride_ch, NUM_Q_HEADS, NUM_K_HEADS, eps,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, REST: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr, BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr, HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    k_scale_ptr=None, v_scale_ptr=None, KV_FP8: tl.constexpr = False, KV_SCALE_PER_HEAD: tl.constexpr = False,
):
    """Grid (tokens, q head blocks + 2 x k head blocks): triton_fused._qk_norm_rope_kernel's
    programs for q and k (optional per-head RMSNorm, then rotary, in place), the k ones also
    writing their result into the token's slot of the K pool, then programs copying HEADS v heads
    each into the V pool; slot -1 writes nothing. One launch where there were two (the rotary's and
    write_kv_kernel's) and no second read of k and v. An fp8 pool gets what write_kv_kernel writes:
    the activations' values / scale (one, or one per KV head), saturated, rounded to nearest even."""
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    q_blocks = (NUM_Q_HEADS + HEADS - 1) // HEADS
    k_blocks = (NUM_K_HEADS + HEADS - 1) // HEADS
    h = tl.arange(0, HEADS)
    cos = cos_ptr + t * cos_stride
    sin = sin_ptr + t * sin_stride
    if block < q_blocks:
        heads = block * HEADS + h
        norm_rope_heads(q_ptr + t * q_stride_t, heads, heads < NUM_Q_HEADS, q_stride_h, qw_ptr, cos, sin, eps,
                         HEAD_DIM, HALF, REST, BLOCK_HALF, BLOCK_REST, HAS_NORM)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        ok = slot >= 0
        slot = tl.maximum(slot, 0)  # (an address computed for slot -1 is never written)
        row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
        if block < q_blocks + k_blocks:
            heads = (block - q_blocks) * HEADS + h
            norm_rope_heads(k_ptr + t * k_stride_t, heads, heads < NUM_K_HEADS, k_stride_h, kw_ptr, cos, sin, eps,
                            HEAD_DIM, HALF, REST, BLOCK_HALF, BLOCK_REST, HAS_NORM,
                            k_cache_ptr + row, stride_ch, ok, True, k_scale_ptr, KV_FP8, KV_SCALE_PER_HEAD)
        else:
            heads = (block - q_blocks - k_blocks) * HEADS + h
            d = tl.arange(0, BLOCK_D)[None, :]
            m = (heads < NUM_K_HEADS)[:, None] & (d < HEAD_DIM)
            x = tl.load(v_ptr + t * v_stride_t + heads[:, None] * v_stride_h + d, mask=m, other=0.0)
            x = pool_value(x.to(tl.float32), v_ptr, v_cache_ptr, v_scale_ptr, heads, heads < NUM_K_HEADS, KV_FP8,
                           KV_SCALE_PER_HEAD)
            tl.store(v_cache_ptr + row + heads[:, None] * stride_ch + d, x, mask=m & ok)


@triton.jit
def copy_blocks_kernel(
    k_cache_ptr, v_cache_ptr, pairs_ptr, stride_cb,
    BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr,
):
    """Program (pair, chunk) copies CHUNK elements of block src -> block dst, in K and in V."""
    p = tl.program_id(0)
    c = tl.program_id(1)
    src = tl.load(pairs_ptr + 2 * p).to(tl.int64)
    dst = tl.load(pairs_ptr + 2 * p + 1).to(tl.int64)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    k = tl.load(k_cache_ptr + src * stride_cb + offs, mask=mask)
    v = tl.load(v_cache_ptr + src * stride_cb + offs, mask=mask)
    tl.store(k_cache_ptr + dst * stride_cb + offs, k, mask=mask)
    tl.store(v_cache_ptr + dst * stride_cb + offs, v, mask=mask)


def check_pool_layout(cache: torch.Tensor, head_dim: int) -> None:
    if cache.dim() != 4 or cache.shape[3] != head_dim or cache.stride(3) != 1:
        raise ValueError(f"KV cache must be [num_blocks, block_size, num_kv_heads, {head_dim}] with "
                         f"contiguous head_dim, got shape {tuple(cache.shape)} strides {cache.stride()}")


def fp8_scale_args(cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> dict:
    """The kernels' FP8 arguments: the scale pointers (1.0 where none is given) for an fp8 pool, and
    KV_SCALE_PER_HEAD when they are [num_kv_heads] (per tensor: the argument is left out, so those
    launches are the same compiled variant, with the same instructions, as before per-head scales)."""
    if not is_fp8(cache):
        return {}
    one = None
    if k_scale is None or v_scale is None:
        one = torch.ones(1, dtype=torch.float32, device=cache.device)
    k_scale = one if k_scale is None else k_scale
    v_scale = one if v_scale is None else v_scale
    if k_scale.numel() == 1 and v_scale.numel() == 1:
        return dict(k_scale_ptr=k_scale, v_scale_ptr=v_scale, KV_FP8=True)
    num_kv_heads = cache.shape[2]
    if k_scale.numel() != num_kv_heads or v_scale.numel() != num_kv_heads or not k_scale.is_contiguous() \
            or not v_scale.is_contiguous():
        raise ValueError(f"FP8 KV scales must be both [1] or both [num_kv_heads={num_kv_heads}] and contiguous, "
                         f"got {list(k_scale.shape)} and {list(v_scale.shape)}")
    return dict(k_scale_ptr=k_scale, v_scale_ptr=v_scale, KV_FP8=True, KV_SCALE_PER_HEAD=True)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Scatter new K/V ([num_tokens, num_kv_heads, head_dim]) into their slots; slot -1 is skipped.
    An fp8 pool is written quantized, in the same kernel (x / scale, e4m3)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    check_pool_layout(k_cache, head_dim)
    if key.stride(2) != 1 or value.stride(2) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("write_kv needs contiguous head_dim in key/value and K/V pools of one layout")
    write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1], **fp8_scale_args(k_cache, k_scale, v_scale),
    )


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                  eps: float = 1e-6, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> None:
    """layers/triton_fused.qk_norm_rotary_ on q [T, Hq, D] and k [T, Hk, D] (in place; optional
    per-head RMSNorm weights [D]), then write_kv of the rotated k and of v [T, Hk, D] (with its
    scales for an fp8 pool), in one launch (rope_write_kv_kernel): the same bytes as the two."""
    T, num_q, D = q.shape
    num_k = k.shape[1]
    rd = cos.shape[-1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or rd % 2 or rd > D or k.shape[-1] != D \
            or tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"rope_write_kv: needs unit-stride head dims, v shaped as k and an even rotary_dim <= "
                         f"head_dim, got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, rotary_dim {rd}")
    check_pool_layout(k_cache, D)
    if (k_cache.dtype != k.dtype and not is_fp8(k_cache)) or k_cache.stride() != v_cache.stride():
        raise ValueError(f"rope_write_kv: needs K/V pools of one layout in the activations' dtype ({k.dtype}) or "
                         f"fp8, got {k_cache.dtype}")
    if T == 0:
        return
    has_norm = q_weight is not None
    cos2, sin2 = cos.reshape(T, rd), sin.reshape(T, rd)
    heads = min(QK_ROPE_HEADS, next_power_of_2(max(num_q, num_k)))
    rope_write_kv_kernel[(T, cdiv(num_q, heads) + 2 * cdiv(num_k, heads))](
        q, k, v, q_weight if has_norm else q, k_weight if has_norm else k, cos2, sin2, k_cache, v_cache,
        slot_mapping, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos2.stride(0), sin2.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), num_q, num_k, eps,
        HEAD_DIM=D, HALF=rd // 2, REST=D - rd, BLOCK_HALF=next_power_of_2(max(rd // 2, 1)),
        BLOCK_REST=next_power_of_2(max(D - rd, 1)), BLOCK_D=next_power_of_2(D), HAS_NORM=has_norm, HEADS=heads,
        BLOCK_SIZE=k_cache.shape[1], num_warps=4, **fp8_scale_args(k_cache, k_scale, v_scale))


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                pairs: list[tuple[int, int]]) -> None:
    """Copy-on-write: block src -> block dst in every layer's pools (one launch per layer)."""
    if not pairs:
        return
    pair_t = torch.tensor(pairs, dtype=torch.int64).to(k_caches[0].device, non_blocking=True)
    for k, v in zip(k_caches, v_caches):
        if is_fp8(k):  # bytes are bytes: an fp8 block moves as uint8, scales and all (they are per layer)
            k, v = k.view(torch.uint8), v.view(torch.uint8)
        if k.stride() != v.stride() or not k[0].is_contiguous():
            raise ValueError("copy_blocks needs K/V pools of one layout with contiguous blocks")
        numel = k[0].numel()
        chunk = min(4096, next_power_of_2(numel))
        copy_blocks_kernel[(len(pairs), cdiv(numel, chunk))](
            k, v, pair_t, k.stride(0), BLOCK_NUMEL=numel, CHUNK=chunk, num_warps=4)
