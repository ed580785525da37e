"""moe_offline.py --one-engine on CPU (a tiny Qwen3-MoE): both workloads on one LLM do each
workload's whole work, the second workload's first run finds nothing of the first's in the prefix
cache, and the decode-step roofline fraction counts decode-only steps. vs_vllm's saturation rule
counts the full batch's token rate, not the tail."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks/offline"))
sys.path.insert(0, str(ROOT / "benchmarks/serving"))

from pagedserve.benchmark.roofline import ModelCost  # noqa: E402
from pagedserve.benchmark.throughput import fitted_workload  # noqa: E402
from pagedserve.models.loader import load_hf_config  # noqa: E402


def test_one_engine_runs_every_workload_whole(tmp_path, tiny_model_dir):
    # 1,024 positions: the workloads are drawn to fit (fitted_workload), half the decode steps.
    model = tiny_model_dir("qwen3_moe", vocab_size=10240, max_position_embeddings=1024)
    out = tmp_path / "moe.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/offline/moe_offline.py"), "--one-engine",
                           "--models", str(model), "--workloads", "fixed256", "nanovllm", "--repeats", "1",
                           "--num-requests", "2", "--engine-args", "--device cpu --dtype float32 --block-size 16",
                           "--output", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    name = Path(model).name
    for wl in ("fixed256", "nanovllm"):
        res, reqs = doc["results"][f"{name}_{wl}"], fitted_workload(wl, 2, load_hf_config(model), 1024)
        assert res["prompt_tokens"] == sum(len(r.prompt_token_ids) for r in reqs)
        assert res["output_tokens"] == sum(r.output_len for r in reqs)
        assert [r["prefix_cache_hit_tokens"] for r in res["runs"]] == [0]  # cold, after the other workload
    assert doc["config"]["one_engine"] is True and doc["switches"]["tensor_parallel_size"] == 1


def test_decode_fraction_counts_decode_steps_only():
    from moe_engine_runs import decode_fraction
    from offline_steps import step_ideal_s
    cost = ModelCost(weight_bytes=10**8, matmul_params=2 * 10**8, lm_head_params=10**7, kv_bytes_per_token=10**5,
                     attn_flops_per_pair=10**4, expert_bytes=10**7, num_experts=16, top_k=2)
    decode = [{"seqs": 4, "decodes": 4, "tokens": 4, "context": 4000, "busy_ms": 1.0},
              {"seqs": 8, "decodes": 8, "tokens": 8, "context": 9000, "busy_ms": 2.0}]
    mixed = [{"seqs": 3, "decodes": 2, "tokens": 500, "context": 1500, "busy_ms": 9.0},
             {"seqs": 0, "decodes": 0, "tokens": 0, "context": 0, "busy_ms": 0.5}]
    got = decode_fraction(decode + mixed, cost, 4e12, 8e14)
    ideal = sum(step_ideal_s(s, cost, 4e12, 8e14) for s in decode)
    assert got["decode_steps"] == 2 and got["decode_busy_s"] == 0.003
    assert got["decode_roofline_fraction"] == round(ideal / 0.003, 3)


def test_saturation_is_the_full_batch_token_rate_over_the_mean_length():
    from vs_vllm import saturation_req_s
    # 100 requests sent at once, 100 tokens a second each from t=0: 10 of 100 tokens (done at 1 s),
    # 90 of 1,000. Until the 10th finishes: 10,000 tokens in 1 s; mean length 910 -> 10.99 req/s,
    # which is also what 100 in flight at 100 tokens/s each sustain with these lengths.
    reqs = [{"sent_at": 0.0, "ttft": 0.0, "latency": n / 100, "output_len": n, "error": None}
            for n in [100] * 10 + [1000] * 90]
    assert abs(saturation_req_s(reqs) - 10000 / 910) < 1e-9
    assert len(reqs) / 10.0 < 10000 / 910  # the whole run's requests/s (tail included) says less


def test_probe_sets_the_rates_both_engines_run(tmp_path, monkeypatch):
    """vLLM's probe (bench serve stubbed: 100 requests of 100 tokens in 1 s, so 100 req/s) gives the rates
    at the fractions asked, in rates.json and args.rates; pagedserve's side reads the same rates;
    with no usable probe both keep --rates."""
    import argparse

    import vs_vllm

    def fake_bench_serve(args, engine, port, rate, num, out, model_dir, work, salt=0):
        reqs = [{"sent_at": 0.0, "ttft": 0.0, "latency": 1.0, "output_len": 100, "error": None} for _ in range(num)]
        out.write_text(json.dumps({"results": {"requests": reqs, "request_throughput": 1.0}}))
    monkeypatch.setattr(vs_vllm, "bench_serve", fake_bench_serve)
    args = argparse.Namespace(saturation_fractions=[0.3, 0.6, 0.9], probe_requests=None, num_requests=100,
                              rates=[10.0, 20.0, 40.0], startup_limit=1, rate_limit=1)
    vs_vllm.probe_rates(args, 0, tmp_path, tmp_path)
    assert args.rates == [30.0, 60.0, 90.0]
    ours = argparse.Namespace(**{**vars(args), "rates": [10.0, 20.0, 40.0]})
    assert vs_vllm.wait_for_rates(ours, tmp_path) and ours.rates == [30.0, 60.0, 90.0]

    (tmp_path / "rates.json").unlink()
    monkeypatch.setattr(vs_vllm, "bench_serve", lambda *a, **k: None)  # no probe file
    args.rates = [10.0, 20.0, 40.0]
    vs_vllm.probe_rates(args, 0, tmp_path, tmp_path)
    saved = json.loads((tmp_path / "rates.json").read_text())
    assert saved["rates"] == [10.0, 20.0, 40.0] and saved["saturation_req_s"] is None


def test_slow_rates_send_fewer_requests_alike():
    import argparse

    from vs_vllm import requests_at
    args = argparse.Namespace(num_requests=120, max_arrival_seconds=45.0)
    assert [requests_at(args, r) for r in (1.0, 2.1, 6.3)] == [60, 94, 120]
    args.max_arrival_seconds = None
    assert requests_at(args, 1.0) == 120
