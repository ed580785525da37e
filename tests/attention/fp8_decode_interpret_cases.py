"""Cases for the FP8 KV decode launch variants (decode_plan.DECODE_FP8_LAUNCH: BLOCK_N, warps,
stages, the f16 cast) under the Triton interpreter (CPU), checked against reference.py over the
dequantized pools; run by test_fp8_decode_interpret.py in a subprocess with TRITON_INTERPRET=1
(see triton_interpret_cases.py for why). Tiny shapes: seconds.

bf16 queries are checked only with the f16 cast here: with it the kernel's dots are fp16, which the
interpreter multiplies right; its bf16 tl.dot does not (bf16 is test_fp8_gpu.py's)."""
import os

import pytest
import torch

from pagedserve.attention import reference
from paged_batch import make_batch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_fp8_decode_interpret.py (needs TRITON_INTERPRET=1 before importing triton)",
                allow_module_level=True)

from interpreter_fixes import apply as _fix_interpreter  # noqa: E402

_fix_interpreter()

from pagedserve.attention import decode_plan, triton_ops as ops  # noqa: E402
from pagedserve.attention.kv_quant import quantize_kv  # noqa: E402

# Half-precision dots over e4m3 tiles, fp32 softmax and accumulation: the kernels' FP8 tolerance.
TOL = dict(rtol=2e-2, atol=2e-2)
SCALES = {"per_tensor": (torch.tensor([0.03]), torch.tensor([0.02])),
          "per_head": (torch.tensor([0.002, 0.08, 0.03]), torch.tensor([0.05, 0.00125, 0.01]))}


def _decodes(scales: str, seed: int):
    """Four decodes (contexts 6 to 71, one a tile of its own at BLOCK_N 64) over e4m3 pools, and the
    reference over float32 pools of the same values dequantized."""
    hkv = SCALES[scales][0].numel() if scales == "per_head" else 2
    batch = make_batch([(20, 1), (70, 1), (5, 1), (37, 1)], 4, H=2 * hkv, Hkv=hkv, D=16, block_size=8, seed=seed)
    ks, vs = SCALES[scales]
    kc, vc = quantize_kv(batch.k_cache, ks), quantize_kv(batch.v_cache, vs)
    ops.write_kv(batch.new_k, batch.new_v, kc, vc, batch.meta.slot_mapping, ks, vs)
    ref = reference.paged_attention(batch.query, kc.float() * ks[:, None], vc.float() * vs[:, None], batch.meta,
                                    scale=0.25)
    return batch, kc, vc, ks, vs, ref


def _decode(batch, kc, vc, ks, vs, query=None, **launch):
    q = batch.query if query is None else query
    out = torch.empty_like(q)
    m = batch.meta
    return ops.paged_decode(q, kc, vc, m.seq_lens, m.block_tables, m.max_seq_len, 0.25, out,
                            k_scale=ks, v_scale=vs, **launch)


# Warps and stages mean nothing to the interpreter (the GPU tests cover them), so each tile size
# runs with one scale strategy: every tile size and both strategies, at half the interpreter time.
@pytest.mark.parametrize("block_n,num_warps,num_stages,scales", [(16, 4, 3, "per_tensor"), (32, 8, 2, "per_head"),
                                                                 (64, 4, 4, "per_head")])
@pytest.mark.parametrize("f16_dot,qdtype", [(False, torch.float16), (True, torch.float16), (True, torch.bfloat16)])
def test_fp8_decode_launch_variants_match_reference(block_n, num_warps, num_stages, scales, f16_dot, qdtype):
    batch, kc, vc, ks, vs, ref = _decodes(scales, seed=block_n)
    out = _decode(batch, kc, vc, ks, vs, query=batch.query.to(qdtype), block_n=block_n, num_warps=num_warps,
                  num_stages=num_stages, f16_dot=f16_dot)
    assert out.dtype == qdtype
    torch.testing.assert_close(out.float(), ref, **TOL)


@pytest.mark.parametrize("num_splits", [2, 4])
def test_fp8_f16_cast_split_k_matches_reference(num_splits):
    """The f16 cast through split-K and the reduction, bf16 queries (serving's)."""
    batch, kc, vc, ks, vs, ref = _decodes("per_tensor", seed=9)
    out = _decode(batch, kc, vc, ks, vs, query=batch.query.bfloat16(), block_n=16, f16_dot=True,
                  num_splits=num_splits, split_tokens=0)
    torch.testing.assert_close(out.float(), ref, **TOL)


def test_fp8_f16_cast_saturates_q_beyond_fp16():
    """A bf16 q component past fp16's range (1e5) is read as 65504, not inf: the output is finite
    and is attention with q clamped there."""
    batch, kc, vc, ks, vs, _ = _decodes("per_tensor", seed=4)
    q = batch.query.clone()
    q[0, 0, 3], q[2, 1, 0] = 1e5, -3e5
    ref = reference.paged_attention(q.clamp(-65504, 65504), kc.float() * ks, vc.float() * vs, batch.meta, scale=0.25)
    out = _decode(batch, kc, vc, ks, vs, query=q.bfloat16(), block_n=16, f16_dot=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, **TOL)


def test_fp8_f16_cast_leaves_float32_queries_ieee():
    """float32 queries over an fp8 cache keep their fp32 (IEEE) dots: f16_dot does not apply."""
    batch, kc, vc, ks, vs, ref = _decodes("per_tensor", seed=5)
    out = _decode(batch, kc, vc, ks, vs, block_n=32, f16_dot=True)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_paged_attention_takes_the_fp8_launch(monkeypatch):
    """paged_attention runs an fp8 cache's decodes with fp8_decode_launch_settings() (f16 and its
    BLOCK_N), read from decode_plan at the launch, a mixed batch's prefill beside them as before."""
    batch = make_batch([(20, 1), (70, 1), (0, 9), (13, 6)], 2, H=4, Hkv=2, D=16, block_size=8, seed=8)
    ks, vs = SCALES["per_tensor"]
    kc, vc = quantize_kv(batch.k_cache, ks), quantize_kv(batch.v_cache, vs)
    ops.write_kv(batch.new_k, batch.new_v, kc, vc, batch.meta.slot_mapping, ks, vs)
    ref = reference.paged_attention(batch.query, kc.float() * ks, vc.float() * vs, batch.meta, scale=0.25)
    launched = []
    real = ops.paged_decode_kernel

    class Recorder:  # the decode kernel as paged_decode launches it: its BLOCK_N and the f16 cast
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append((kwargs["BLOCK_N"], kwargs.get("F16_DOT", False)))
                return real[grid](*args, **kwargs)
            return launch
    monkeypatch.setattr(decode_plan, "fp8_decode_launch_settings",
                        lambda: decode_plan.DecodeLaunch(block_n=32, f16_dot=True))
    monkeypatch.setattr(ops, "paged_decode_kernel", Recorder())
    out = ops.paged_attention(batch.query.to(torch.float16), kc, vc, batch.meta, 0.25, k_scale=ks, v_scale=vs)
    assert launched == [(32, True)]
    torch.testing.assert_close(out.float(), ref, **TOL)
