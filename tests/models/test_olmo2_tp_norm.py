"""OLMo 2's q/k norms under tensor parallelism, every rank simulated in one process: each rank's
q and k, normalised with the all-reduced sums of squares and its slice of the norm weights, put
back together equal the unsharded layer's, including where KV heads are replicated on several
ranks (their squares must be counted once). The TP=2 engine runs in
tests/distributed/test_tp_generate.py; this covers rank counts and replications it cannot."""
import pytest
import torch

from pagedserve.models import olmo2
from pagedserve.models.olmo2 import Olmo2Attention
from tiny_models import tiny_config


def build(config, full: dict, tp_rank: int, tp_size: int) -> Olmo2Attention:
    """One rank's attention, its parameters read from the full tensors by their own loaders."""
    attn = Olmo2Attention(config, tp_rank, tp_size)
    with torch.no_grad():
        for shard in ("q", "k", "v"):
            attn.qkv_proj.weight_loader(attn.qkv_proj.weight, full[f"{shard}_proj"], shard)
        attn.q_norm.weight.weight_loader(attn.q_norm.weight, full["q_norm"])
        attn.k_norm.weight.weight_loader(attn.k_norm.weight, full["k_norm"])
    return attn


def project_all_ranks(monkeypatch, attns, x):
    """Every rank's project(x), with the all-reduce played in two passes: the first records each
    rank's partial sums, the second hands every rank their total."""
    partials = []
    monkeypatch.setattr(olmo2, "all_reduce", lambda t, tp_size: partials.append(t.clone()) or t)
    for a in attns:
        a.project(x)
    assert len(partials) == len(attns)
    total = torch.stack(partials).sum(0)
    monkeypatch.setattr(olmo2, "all_reduce", lambda t, tp_size: total.clone())
    return [a.project(x) for a in attns]


@pytest.mark.parametrize("tp_size,num_kv_heads", [(2, 2), (4, 4), (2, 1), (4, 1), (4, 2)])
def test_sharded_qk_norm_matches_unsharded(monkeypatch, tp_size, num_kv_heads):
    config = tiny_config("olmo2", 384, num_key_value_heads=num_kv_heads)
    d, heads = config.hidden_size // config.num_attention_heads, config.num_attention_heads
    g = torch.Generator().manual_seed(0)
    full = {"q_proj": torch.randn(heads * d, config.hidden_size, generator=g),
            "k_proj": torch.randn(num_kv_heads * d, config.hidden_size, generator=g),
            "v_proj": torch.randn(num_kv_heads * d, config.hidden_size, generator=g),
            # off 1, and different per row, so a rank reading the wrong rows shows
            "q_norm": 1 + 0.5 * torch.randn(heads * d, generator=g),
            "k_norm": 1 + 0.5 * torch.randn(num_kv_heads * d, generator=g)}
    x = torch.randn(5, config.hidden_size, generator=g)
    ref_q, ref_k, _ = build(config, full, 0, 1).project(x)

    attns = [build(config, full, r, tp_size) for r in range(tp_size)]
    outs = project_all_ranks(monkeypatch, attns, x)
    torch.testing.assert_close(torch.cat([q for q, _, _ in outs], dim=1), ref_q)
    for a, (_, k, _) in zip(attns, outs):  # each rank's KV heads, replicated ones included
        start = a.qkv_proj.kv_head_start
        torch.testing.assert_close(k, ref_k[:, start:start + a.num_kv_heads])
    # every KV head is held by some rank
    assert {a.qkv_proj.kv_head_start + j for a in attns for j in range(a.num_kv_heads)} == set(range(num_kv_heads))
