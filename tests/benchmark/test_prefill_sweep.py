"""benchmarks/kernels/prefill_sweep.py without a GPU: its FLOP count, shapes (shuffled tables) and
SDPA reference agree with pagedserve's own reference attention, its check tells a wrong causal
alignment from a right one, and its pick takes the fastest correct launch by geometric mean."""
import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks/kernels"))
import prefill_sweep as ps  # noqa: E402

from pagedserve.attention import reference  # noqa: E402


@pytest.mark.parametrize("c,L", [(1, 1), (5, 5), (5, 13), (16, 100)])
def test_flops_count_the_visible_pairs(c, L):
    pos = torch.arange(L)
    visible = (pos[None, :] <= (L - c + torch.arange(c))[:, None]).sum().item()
    assert ps.visible_pairs(c, L) == visible
    assert ps.attention_flops(c, L, num_heads=3, head_dim=8) == 4 * 8 * 3 * visible
    # the 100k chunk of the issue: 8192 queries over 91,808 earlier keys plus their own triangle
    assert ps.visible_pairs(8192, 100000) == 8192 * 91808 + 8192 * 8193 // 2


def test_candidates_parse_back_default_first():
    prefill, unified = ps.candidates("paged_prefill"), ps.candidates("unified")
    assert len(prefill) == len(set(prefill)) == 2 * 3 * 2 * 3 * 2
    assert len(unified) == len(set(unified)) == 3 * 3 * 2 * 2
    assert prefill[0] == "bm128+bn128+w8+s4" and unified[0] == "bm64+bn64+w4+s2"  # Hopper defaults
    assert "bm64+bn64+w4+s2" in prefill  # other GPUs' default
    assert sum(n.endswith("+gqa") for n in prefill) == len(prefill) // 2
    for kernel, names in (("paged_prefill", prefill), ("unified", unified)):
        parse = ps.KERNELS[kernel][3]
        assert [parse(n).name(ps.KERNELS[kernel][2]) for n in names] == names
    order = ps.schedule(["paged_prefill", "unified"], "full")
    assert sorted(order) == sorted([("paged_prefill", n) for n in prefill] + [("unified", n) for n in unified])
    assert [k for k, _ in order[:4]] == ["paged_prefill", "unified"] * 2
    assert len(ps.candidates("paged_prefill", "quick")) < len(prefill)


def test_parse_shapes():
    assert ps.parse_shapes("8192x32768,2048x65536") == [(8192, 32768), (2048, 65536)]
    for bad in ("8192", "8192x100", "ax5"):
        with pytest.raises(ValueError):
            ps.parse_shapes(bad)


def test_shape_reference_matches_paged_reference():
    """The shuffled table is a permutation's prefix; SDPA over the gathered K/V with the
    lower-right mask is pagedserve's reference attention over the pool; the upper-left mask (a
    chunk aligned to position 0) fails the check."""
    from torch.nn.attention import SDPBackend
    shape = ps.make_shape(5, 29, "cpu", seed=3, dtype=torch.float32, num_heads=4, num_kv_heads=2, head_dim=16,
                          block_size=4)
    table = shape.table[0].tolist()
    assert len(table) == 8 == len(set(table)) and table != sorted(table)
    q4, k4, v4 = ps.sdpa_inputs(shape)
    got = ps.sdpa_attention(q4, k4, v4, [SDPBackend.MATH])
    meta = shape.meta()
    meta.block_size = 4
    want = reference.paged_attention(shape.query, shape.k_cache, shape.v_cache, meta, scale=16 ** -0.5)
    err, ok = ps.check_output(got, want, rtol=1e-5)
    assert ok, err
    upper_left = torch.nn.functional.scaled_dot_product_attention(q4, k4[:, :, :5], v4[:, :, :5], is_causal=True)
    assert not ps.check_output(upper_left[0].transpose(0, 1), want)[1]


def test_check_output_rejects_nan_and_drift():
    ref = torch.randn(6, 4, 16)
    assert ps.check_output(ref.to(torch.bfloat16), ref) == (pytest.approx(0, abs=5e-3), True)
    off = ref.clone()
    off[3, 1] *= 1.1  # one (token, head) row 10% off
    err, ok = ps.check_output(off, ref)
    assert not ok and err == pytest.approx(0.1, rel=1e-3)
    nan = ref.clone()
    nan[0, 0, 0] = float("nan")
    assert ps.check_output(nan, ref) == (math.inf, False)


def _run(ms, err=1e-3):
    return {"ms": ms, "max_rel_err": err, "tflops": 1.0}


RUNS = {
    "paged_prefill": {
        "bm128+bn128+w8+s4": {"a": _run(4.0), "b": _run(40.0)},      # the (Hopper) default: geomean 12.65
        "bm128+bn64+w8+s3": {"a": _run(2.0), "b": _run(50.0)},       # geomean 10.0: the pick
        "bm128+bn64+w8+s3+gqa": {"a": _run(1.0), "b": _run(5.0, err=0.5)},   # fastest, wrong on b
        "bm64+bn64+w4+s2": {"a": _run(1.0), "b": {"error": "OutOfResources"}},
        "bm64+bn32+w4+s2": {"a": _run(1.0)},                         # b not reached
        "bm64+bn128+w4+s2": {"a": _run(3.0), "b": _run(40.0)},       # geomean 10.95
    },
}


def test_pick_is_the_fastest_correct_by_geometric_mean():
    got = ps.picks(RUNS, ["a", "b"])["paged_prefill"]
    assert got["launch"] == "bm128+bn64+w8+s3" and got["switch"] == "PAGEDSERVE_PREFILL_LAUNCH=bm128+bn64+w8+s3"
    assert got["geomean_ms"] == pytest.approx(10.0)
    assert got["over_default"] == pytest.approx(10.0 / math.sqrt(160))
    assert got["correct_launches"] == 3
    assert [n for n, _ in ps.ranking(RUNS["paged_prefill"], ["a", "b"])] == [
        "bm128+bn64+w8+s3", "bm64+bn128+w4+s2", "bm128+bn128+w8+s4"]
    # a looser tolerance lets the packed launch in (it was timed although outside 2e-2)
    assert ps.picks(RUNS, ["a", "b"], rtol=0.6)["paged_prefill"]["launch"] == "bm128+bn64+w8+s3+gqa"
    assert "unified" not in ps.picks(RUNS, ["a", "b"])


def test_pick_from_a_saved_result(tmp_path, capsys):
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"config": {"shapes": [[8, 16], [4, 64]]},
                                "results": {"unified": {"bm128+bn32+w8+s2": {"8x16": _run(1.0), "4x64": _run(2.0)},
                                                        "bm64+bn64+w4+s2": {"8x16": _run(1.5), "4x64": _run(2.0)}},
                                            "pick": {}, "not_reached": []}}))
    assert ps.main(["--pick", str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == ["PAGEDSERVE_UNIFIED_LAUNCH=bm128+bn32+w8+s2"]


@pytest.mark.parametrize("bad, match", [("paged_prefill:bm48", "PAGEDSERVE_PREFILL_LAUNCH"),
                                        ("prefill:bm64", "--launches"), ("paged_prefill", "--launches"),
                                        # 'default' names the kernel's Hopper default: the next item is the bad one
                                        ("paged_prefill:default,prefill:bm64", "'prefill:bm64'")])
def test_launches_refuse_a_bad_item_before_any_work(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        ps.main(["--launches", bad, "--output", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def math_piece(q, k, v, causal):
    """(out, lse) of plain softmax attention, causal top-left: the CPU stand-in for the CUDA ops."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v, scores.logsumexp(-1)


@pytest.mark.parametrize("c,L", [(4, 4), (5, 13), (16, 100)])
def test_split_attention_equals_lower_right_causal(c, L):
    """The split baselines' merge: prefix (no mask) + the chunk's own square (causal), combined by
    log-sum-exp, is the chunk's lower-right causal attention over the whole context."""
    torch.manual_seed(0)
    q4, k4, v4 = (torch.randn(1, 3, n, 8, dtype=torch.float64) for n in (c, L, L))
    got = ps.split_attention(q4, k4, v4, math_piece)
    ref = ps.sdpa_attention(q4, k4, v4, [torch.nn.attention.SDPBackend.MATH])
    assert torch.allclose(got, ref, atol=1e-12)
    # the top-left causal attention over the whole context (the wrong alignment) is not it
    wrong = math_piece(q4, k4, v4, True)[0][0].transpose(0, 1)
    assert c == L or not torch.allclose(wrong, ref, atol=1e-3)


def biased_math_piece(q, k, v, causal, bias=None):
    """math_piece with cuDNN's additive bias argument."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 + (0 if bias is None else bias)
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v, scores.logsumexp(-1)


@pytest.mark.parametrize("name", ["sdpa_cudnn_fold_split", "sdpa_cudnn_padded_split"])
@pytest.mark.parametrize("c,L", [(5, 13), (16, 100), (8, 8)])
def test_folded_and_padded_pieces_equal_lower_right_causal(name, c, L):
    """The engine-shaped cuDNN calls: query heads of a KV group folded into the query length over
    un-repeated K/V, and the prefix padded with zero K/V to a bucket, the pad masked by a bias row."""
    torch.manual_seed(1)
    group, kv_heads = 3, 2
    q4 = torch.randn(1, group * kv_heads, c, 8, dtype=torch.float64)
    k4, v4 = (torch.randn(1, kv_heads, L, 8, dtype=torch.float64).repeat_interleave(group, 1) for _ in "kv")
    piece = ps.library_pieces(group, pad_to=32, base=biased_math_piece)[name]
    got = ps.split_attention(q4, k4, v4, piece)
    ref = ps.sdpa_attention(q4, k4, v4, [torch.nn.attention.SDPBackend.MATH])
    assert torch.allclose(got, ref, atol=1e-12)


def test_runner_passes_every_flag_of_the_launch(monkeypatch):
    """A launch's flags reach the kernel (before 2026-12-03 lpt did not: the sweep's "+lpt" rows,
    prefill_sweep.json at 3368ebd included, timed the launch without it)."""
    from pagedserve.attention import triton_ops
    seen = {}
    monkeypatch.setattr(triton_ops, "paged_prefill", lambda *a, **kw: seen.update(kw))
    shape = ps.make_shape(5, 40, "cpu", dtype=torch.float32, block_size=32)
    assert shape.meta().block_size == 32
    ps.make_runner("paged_prefill", shape, "bm128+bn32+w8+s3+gqa+lpt+tma+ws", torch.empty(1))()
    assert {k: seen[k] for k in ("gqa", "lpt", "tma", "ws", "block_n")} == dict(gqa=True, lpt=True, tma=True, ws=True,
                                                                                  block_n=32)


def test_sweep_runs_under_the_interpreter(tmp_path):
    """--device cpu under TRITON_INTERPRET=1 (a subprocess: the switch is read at import): both a
    gather launch and a tma one are checked against SDPA and pass, and the pick names one of them."""
    import os
    import subprocess
    out = tmp_path / "sweep.json"
    launches = "paged_prefill:bm16+bn16+w4+s2,paged_prefill:bm16+bn16+w4+s2+tma"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, str(ROOT / "benchmarks/kernels/prefill_sweep.py"), "--device", "cpu",
                    "--dtype", "float32", "--shapes", "16x48", "--launches", launches, "--block-size", "16",
                    "--reps", "1", "--lpt-top", "0", "--output", str(out)], check=True, env=env, timeout=600,
                   capture_output=True)
    runs = json.loads(out.read_text())["results"]["paged_prefill"]
    assert set(runs) == {"bm16+bn16+w4+s2", "bm16+bn16+w4+s2+tma"}
    assert all(r["16x48"]["within_rtol"] for r in runs.values()), runs
    assert json.loads(out.read_text())["results"]["pick"]["paged_prefill"]["launch"] in runs
