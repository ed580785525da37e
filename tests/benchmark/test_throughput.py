"""`pagedserve bench throughput` on CPU with a tiny model: the timed runs do the workload's
whole work, and the warm-up leaves none of the timed prompts in the prefix cache."""
import json
import re
import subprocess
import sys

import pytest

from pagedserve.benchmark.throughput import DEFAULT_MODELS, default_model, fitted_workload, warm_up_requests
from pagedserve.models.loader import load_hf_config
from pagedserve.workloads import make_workload


@pytest.mark.parametrize("workload", sorted(DEFAULT_MODELS))
def test_default_models_resolve_from_any_directory(workload, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_hf_config(default_model(workload))
    assert cfg.vocab_size > 10000  # real configs, wide enough for the workloads' token ids


def test_warm_up_has_the_shapes_but_not_the_prompts():
    reqs = make_workload("nanovllm", 8)
    warm = warm_up_requests(reqs, max_tokens=16)
    assert [len(w.prompt_token_ids) for w in warm] == [len(r.prompt_token_ids) for r in reqs]
    assert [w.output_len for w in warm] == [min(r.output_len, 16) for r in reqs]
    assert all(w.prompt_token_ids[0] != r.prompt_token_ids[0] for w, r in zip(warm, reqs))


def test_bench_throughput_counts_the_whole_workload(tmp_path, tiny_model_dir):
    # 512 positions: the workload is drawn to fit (fitted_workload), two fifths of its output tokens.
    model = tiny_model_dir("llama", vocab_size=10240, max_position_embeddings=512)
    out = tmp_path / "ours.json"
    proc = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "throughput",
                           "--workload", "nanovllm", "--model", str(model), "--num-requests", "3",
                           "--device", "cpu", "--dtype", "float32", "--block-size", "16", "--output", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warm-up done" in proc.stderr and "timed run 2/2" in proc.stderr  # not silent for minutes
    # tqdm's bar over each run's requests, with elapsed<remaining (the ETA).
    assert re.search(r"Processed prompts: +\d+%\|.*\| \d+/3 \[\d\d:\d\d<\d\d:\d\d", proc.stderr), proc.stderr[-2000:]
    res = json.loads(out.read_text())["results"]
    reqs = fitted_workload("nanovllm", 3, load_hf_config(model), 512)
    assert res["prompt_tokens"] == sum(len(r.prompt_token_ids) for r in reqs)
    assert res["output_tokens"] == sum(r.output_len for r in reqs)
    first, second = res["runs"]
    # The warm-up's prompts differ from the timed ones: the first timed run computes every prefill.
    assert first["prefix_cache_hit_tokens"] == 0
    # The repeat finds its full prompt blocks cached, all but a last token that must be computed
    # for its logits (vLLM's bar was measured the same way, prefix caching on).
    assert second["prefix_cache_hit_tokens"] == sum((len(r.prompt_token_ids) - 1) // 16 * 16 for r in reqs)


def test_workload_fits_a_small_model_and_is_unchanged_for_a_large_one():
    """The README's CPU example runs a workload on the demo model (2,048 ids, 1,024 positions):
    its requests are drawn to fit; a model as large as the workload assumes gets the documented draw."""
    from pagedserve.demo_model import DEMO_MODEL_DIR
    demo = load_hf_config(DEMO_MODEL_DIR)
    reqs = fitted_workload("sharegpt-like", 200, demo, 1024)
    assert max(t for r in reqs for t in r.prompt_token_ids) < demo.vocab_size
    assert max(len(r.prompt_token_ids) + r.output_len for r in reqs) <= 1024
    warm = warm_up_requests(reqs, vocab=demo.vocab_size)
    assert max(t for r in warm for t in r.prompt_token_ids) < demo.vocab_size
    big = load_hf_config(default_model("nanovllm"))
    assert fitted_workload("sharegpt-like", 50, big, 4096) == make_workload("sharegpt-like", 50)


def test_shared_prefix_len_replaces_the_workloads_system_prompt():
    """A smaller run's shorter system prompt: every request starts with the same prefix of that
    length; left at None the draw is the documented one."""
    reqs = make_workload("shared-prefix", 4, shared_prefix_len=300)
    prefix = reqs[0].prompt_token_ids[:300]
    assert all(r.prompt_token_ids[:300] == prefix for r in reqs)
    assert len({r.prompt_token_ids[300] for r in reqs}) > 1  # the user parts differ right after it
    assert make_workload("shared-prefix", 4, shared_prefix_len=None) == make_workload("shared-prefix", 4)
    assert len(set(tuple(r.prompt_token_ids[:5000]) for r in make_workload("shared-prefix", 4))) == 1
    with pytest.raises(ValueError, match="shared_prefix_len"):
        make_workload("shared-prefix", 4, shared_prefix_len=-1)
