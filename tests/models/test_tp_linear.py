"""Tensor-parallel layers, all ranks simulated in one process: every rank reads only its slice
(straight from a safetensors file) and the ranks' outputs recombine into the unsharded layer's."""
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from pagedserve.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, ParallelLMHead,
                                      QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding)

H, D, HEADS, KV_HEADS, FF, VOCAB = 32, 8, 4, 2, 48, 37


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    w = {"q": torch.randn(HEADS * D, H), "k": torch.randn(KV_HEADS * D, H), "v": torch.randn(KV_HEADS * D, H),
         "qb": torch.randn(HEADS * D), "kb": torch.randn(KV_HEADS * D), "vb": torch.randn(KV_HEADS * D),
         "gate": torch.randn(FF, H), "up": torch.randn(FF, H), "down": torch.randn(H, FF), "down_b": torch.randn(H),
         "emb": torch.randn(VOCAB, H)}
    path = tmp_path_factory.mktemp("tp") / "w.safetensors"
    save_file(w, str(path))
    with safe_open(str(path), "pt") as f:
        yield w, f


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_split_and_replicated_kv(ckpt, tp):
    w, f = ckpt
    x = torch.randn(5, H)
    qs, ks, vs = [], {}, {}
    for r in range(tp):
        layer = QKVParallelLinear(H, D, HEADS, KV_HEADS, bias=True, tp_rank=r, tp_size=tp)
        for sid, wn in (("q", "q"), ("k", "k"), ("v", "v")):
            layer.weight.weight_loader(layer.weight, f.get_slice(wn), sid)
            layer.bias.weight_loader(layer.bias, f.get_slice(wn + "b"), sid)
        q, k, v = layer.split(layer(x))
        qs.append(q)
        heads = range(layer.kv_head_start, layer.kv_head_start + layer.num_kv_heads)
        for j, h in enumerate(heads):
            for store, t in ((ks, k), (vs, v)):
                part = t[:, j * D:(j + 1) * D]
                if h in store:  # replicated head: identical on every rank that holds it
                    torch.testing.assert_close(store[h], part)
                store[h] = part
    torch.testing.assert_close(torch.cat(qs, -1), F.linear(x, w["q"], w["qb"]))
    torch.testing.assert_close(torch.cat([ks[h] for h in range(KV_HEADS)], -1), F.linear(x, w["k"], w["kb"]))
    torch.testing.assert_close(torch.cat([vs[h] for h in range(KV_HEADS)], -1), F.linear(x, w["v"], w["vb"]))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mlp_column_then_row(ckpt, tp):
    w, f = ckpt
    x = torch.randn(3, H)
    total = 0
    for r in range(tp):
        gate_up = MergedColumnParallelLinear(H, [FF, FF], tp_rank=r, tp_size=tp)
        gate_up.weight.weight_loader(gate_up.weight, f.get_slice("gate"), 0)
        gate_up.weight.weight_loader(gate_up.weight, f.get_slice("up"), 1)
        down = RowParallelLinear(FF, H, bias=True, tp_rank=r, tp_size=tp, reduce_results=False)
        down.weight.weight_loader(down.weight, f.get_slice("down"))
        down.bias.weight_loader(down.bias, f.get_slice("down_b"))
        g, u = gate_up(x).chunk(2, -1)
        total = total + F.linear(F.silu(g) * u, down.weight)
    full = F.linear(F.silu(F.linear(x, w["gate"])) * F.linear(x, w["up"]), w["down"], w["down_b"])
    torch.testing.assert_close(total + w["down_b"], full, rtol=1e-4, atol=1e-4)


def test_column_parallel_rows(ckpt):
    w, f = ckpt
    parts = []
    for r in range(2):
        layer = ColumnParallelLinear(H, FF, tp_rank=r, tp_size=2)
        layer.weight.weight_loader(layer.weight, f.get_slice("gate"))
        parts.append(layer.weight)
    torch.testing.assert_close(torch.cat(parts), w["gate"])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_shards_cover_the_vocab_once(ckpt, tp):
    w, f = ckpt
    rows, logits = [], []
    h = torch.randn(2, H)
    for r in range(tp):
        emb = VocabParallelEmbedding(VOCAB, H, tp_rank=r, tp_size=tp)
        emb.weight.weight_loader(emb.weight, f.get_slice("emb"))
        head = ParallelLMHead(VOCAB, H, tp_rank=r, tp_size=tp)
        head.tie(emb)
        rows.append(emb.weight)
        logits.append(F.linear(h, head.weight))
    torch.testing.assert_close(torch.cat(rows)[:VOCAB], w["emb"])
    assert torch.count_nonzero(torch.cat(rows)[VOCAB:]) == 0  # padding rows
    torch.testing.assert_close(torch.cat(logits, -1)[:, :VOCAB], F.linear(h, w["emb"]))


def test_single_rank_layers_never_touch_torch_distributed(ckpt, monkeypatch):
    import torch.distributed as dist
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: (_ for _ in ()).throw(AssertionError("collective")))
    monkeypatch.setattr(dist, "all_gather", lambda *a, **k: (_ for _ in ()).throw(AssertionError("collective")))
    w, f = ckpt
    emb, head = VocabParallelEmbedding(VOCAB, H), ParallelLMHead(VOCAB, H)
    emb.weight.weight_loader(emb.weight, f.get_slice("emb"))
    head.tie(emb)
    row = RowParallelLinear(FF, H)
    row.weight.weight_loader(row.weight, w["down"])
    out = head(row(torch.randn(2, FF)) + emb(torch.tensor([0, 36])))
    assert out.shape == (2, VOCAB)
