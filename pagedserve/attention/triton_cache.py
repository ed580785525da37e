"""Triton kernels that move K/V inside the block pools: slot writes (alone, or with the rotary
that makes K), and block copies.

Pools are [num_blocks, block_size, num_kv_heads, head_dim]; a block is one contiguous
run of block_size * num_kv_heads * head_dim elements, which is what copy_blocks relies on.
"""
import triton
import triton.language as tl

from pagedserve.layers.triton_fused import norm_rope_heads, pool_value


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
