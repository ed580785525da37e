"""FP8 checkpoint layers under tensor parallelism, every rank simulated in one process: each rank
reads its slice of the fp8 weight and of its scales (per tensor for q/k/v, per channel for the row
layer), and the ranks' outputs recombine into the one-rank layer's."""
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from pagedserve.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedserve.layers.quant.fp8 import Fp8Config
from pagedserve.layers.quant.fp8_ops import FP8_MAX, dequantize, quantize_per_channel

H, D, HEADS, KV_HEADS, FF = 32, 16, 4, 2, 64
CKPT_FP8 = Fp8Config(checkpoint_fp8=True, source="test")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    w = {}
    for name, rows in (("q", HEADS * D), ("k", KV_HEADS * D), ("v", KV_HEADS * D)):
        full = torch.randn(rows, H) * (0.5 + len(name))
        s = full.abs().amax() / FP8_MAX  # per tensor
        w[name] = (full / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        w[name + "_scale"] = s.reshape(())
    w["down"], s = quantize_per_channel(torch.randn(H, FF))
    w["down_scale"] = s[:, None].contiguous()  # per channel, [N, 1] as compressed-tensors writes it
    path = tmp_path_factory.mktemp("tp8") / "w.safetensors"
    save_file(w, str(path))
    with safe_open(str(path), "pt") as f:
        yield w, f


def _qkv(f, r, tp):
    layer = QKVParallelLinear(H, D, HEADS, KV_HEADS, tp_rank=r, tp_size=tp, quant_config=CKPT_FP8)
    for sid in "qkv":
        layer.weight.weight_loader(layer.weight, f.get_slice(sid), sid)
        layer.weight_scale.weight_loader(layer.weight_scale, f.get_slice(sid + "_scale"), sid)
    return layer


@pytest.mark.parametrize("tp", [2, 4])
def test_fp8_qkv_ranks_recombine_into_one_rank(ckpt, tp):
    _, f = ckpt
    x = torch.randn(5, H)
    one = _qkv(f, 0, 1)
    q1, k1, v1 = one.split(one(x))
    qs = []
    for r in range(tp):
        layer = _qkv(f, r, tp)
        q, k, v = layer.split(layer(x))
        qs.append(q)
        h = layer.kv_head_start
        torch.testing.assert_close(k, k1[:, h * D:(h + layer.num_kv_heads) * D], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(v, v1[:, h * D:(h + layer.num_kv_heads) * D], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat(qs, -1), q1, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fp8_row_parallel_partial_sums_match_the_dequantized_layer(ckpt, tp):
    w, f = ckpt
    x = torch.randn(3, FF)
    total = 0
    for r in range(tp):
        layer = RowParallelLinear(FF, H, tp_rank=r, tp_size=tp, reduce_results=False, quant_config=CKPT_FP8)
        layer.weight.weight_loader(layer.weight, f.get_slice("down"))
        layer.weight_scale.weight_loader(layer.weight_scale, f.get_slice("down_scale"))
        assert torch.equal(layer.weight_scale, w["down_scale"][:, 0])  # per channel: never split by rank
        n = FF // tp
        total = total + layer(x[:, r * n:(r + 1) * n])  # the all-reduce, by hand
    # each rank quantizes its own slice of x per token, so the sum matches to fp8 activation precision
    want = F.linear(x, dequantize(w["down"], w["down_scale"]))
    assert (total - want).norm() / want.norm() < 0.03
