"""Sliding-window attention end to end: which layers get a window (as transformers builds its
masks), and the engine's greedy tokens equal HF's on prompts and generations past the window,
through chunked prefill (chunks that start inside the window of earlier ones) and decode."""
import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

from pagedserve import LLM, SamplingParams
from pagedserve.attention import Attention
from pagedserve.models.hf_dir import get_max_model_len, sliding_windows
from paged_harness import make_runner
from tiny_models import make_tiny_model

WINDOW = 8
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))
# arch -> the config fields that give it a window (Qwen2: on its second layer only, as
# max_window_layers=1 makes transformers lay it out).
WINDOWED = {
    "mistral": dict(sliding_window=WINDOW),
    "phi3": dict(sliding_window=WINDOW),
    "mixtral": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                  layer_types=["full_attention", "sliding_attention"]),
}


def test_windows_per_layer_follow_transformers():
    mistral = MistralConfig(num_hidden_layers=3, sliding_window=4096)
    assert sliding_windows(mistral, 32768) == [4096] * 3
    assert sliding_windows(mistral, 4096) == [0] * 3  # a window of max_model_len or more never binds
    assert sliding_windows(MistralConfig(num_hidden_layers=2, sliding_window=None), 32768) == [0, 0]
    qwen2 = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=1024, max_window_layers=2)
    assert sliding_windows(qwen2, 32768) == [0, 0, 1024, 1024]
    assert sliding_windows(Qwen2Config(num_hidden_layers=4, sliding_window=1024), 32768) == [0] * 4
    raw = SimpleNamespace(num_hidden_layers=2, sliding_window=64, use_sliding_window=False)  # config.json as read
    assert sliding_windows(raw, 4096) == [0, 0]
    odd = SimpleNamespace(num_hidden_layers=2, sliding_window=64, layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(ValueError, match="chunked_attention"):
        sliding_windows(odd, 4096)
    odd.sliding_window = None  # a kind the kernels lack is refused with no window too
    with pytest.raises(ValueError, match="chunked_attention"):
        sliding_windows(odd, 4096)


def test_max_model_len_is_not_capped_by_the_window():
    """Phi-3-mini-4k (a 2,047-token window) serves its 4,096 positions, as vLLM does."""
    mini_4k = SimpleNamespace(max_position_embeddings=4096, sliding_window=2047, rope_theta=10000.0)
    assert get_max_model_len(mini_4k) == 4096


@pytest.fixture(scope="module")
def windowed_dirs(tmp_path_factory):
    """arch -> (the tiny model with a window of 8, the same weights without one)."""
    dirs = {}
    for arch, fields in WINDOWED.items():
        path = make_tiny_model(arch, tmp_path_factory.mktemp(f"swa-{arch}"), seed=3, **fields)
        plain = tmp_path_factory.mktemp(f"full-{arch}")
        for f in path.iterdir():
            (plain / f.name).write_bytes(f.read_bytes())
        cfg = json.loads((plain / "config.json").read_text())
        # (a Mistral config.json with layer_types at all is read as Ministral's: only where it was)
        cfg.update({k: v for k, v in dict(layer_types=None, use_sliding_window=False).items() if k in cfg},
                   sliding_window=None)
        (plain / "config.json").write_text(json.dumps(cfg))
        dirs[arch] = path, plain
    return dirs


def _hf_greedy(path, prompt, n):
    """HF's tokens, every step a full forward over the whole sequence (no cache: its mask alone)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _ours(path, device, **kw):
    kw = dict(dict(num_gpu_blocks_override=64, swap_space=0.01, block_size=4, max_num_batched_tokens=16,
                   max_num_seqs=4), **kw)
    return LLM(str(path), device=device, dtype="float32", **kw)


def _prompt(n, seed):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("arch", list(WINDOWED))
def test_engine_matches_hf_past_the_window(windowed_dirs, arch, device):
    """Two prompts of 37 and 23 tokens in chunks of at most 16 tokens a step (beside each other's
    decodes), 12 tokens each: every position past the 8-token window. HF without the window
    answers otherwise, so the tokens tell the window apart."""
    windowed, plain = windowed_dirs[arch]
    prompts = [_prompt(37, 1), _prompt(23, 2)]
    expected = [_hf_greedy(windowed, p, 12) for p in prompts]
    assert expected != [_hf_greedy(plain, p, 12) for p in prompts]
    llm = _ours(windowed, device)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def _poison_freed_blocks(llm):
    """Overwrite each block the window frees at once, as if another sequence had taken it: a block
    freed while some position the kernels do not mask still lived in it changes the tokens. (A
    large finite value: every block always holds finite values, which masked reads rely on.)"""
    mgr = llm.llm_engine.scheduler.kv_cache_manager
    pool = llm.llm_engine.runner.cache_engine.gpu_pool
    free_past_window = mgr.free_past_window

    def poisoning(seq):
        before = list(mgr.block_tables[seq.seq_id])
        free_past_window(seq)
        gone = [b.block_id for b, now in zip(before, mgr.block_tables[seq.seq_id]) if b is not None and now is None]
        pool[:, :, gone] = 1e4
    mgr.free_past_window = poisoning


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_blocks_before_the_window_go_back_to_the_pool(windowed_dirs, arch, device):
    """Every layer windowed (Mistral): a sequence holds only the blocks its window reaches, so three
    requests of 9 + 40 tokens (13 blocks each) run side by side in 13 blocks, greedy-equal to HF
    with no preemption; each freed block is overwritten at once (_poison_freed_blocks). Qwen2's full-attention layer
    needs every block: none is freed, and the same requests take turns."""
    windowed, _ = windowed_dirs[arch]
    prompts = [_prompt(9, 5), _prompt(9, 6), _prompt(9, 7)]
    llm = _ours(windowed, device, num_gpu_blocks_override=13, enable_prefix_caching=False, async_scheduling=False)
    _poison_freed_blocks(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(windowed, p, 40) for p in prompts]
    stats = llm.get_kv_cache_stats()
    assert stats.num_blocks_used == 0
    if arch == "mistral":
        assert llm.llm_engine.cache_config.sliding_window == WINDOW
        # each: its window's 2-3 blocks (8 positions, 4 a block) and the one being written
        assert stats.peak_blocks_used <= 3 * 4 and stats.num_preemptions == 0
    else:
        assert llm.llm_engine.cache_config.sliding_window == 0
        assert stats.peak_blocks_used > 12 and stats.num_preemptions > 0


@pytest.mark.parametrize("arch", list(WINDOWED))
def test_layers_get_their_windows(windowed_dirs, arch):
    runner = make_runner(windowed_dirs[arch][0], block_size=4)
    windows = [m.sliding_window for m in runner.model.modules() if isinstance(m, Attention)]
    assert windows == ([0, WINDOW] if arch == "qwen2" else [WINDOW, WINDOW])


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_gathered_long_prefill_only_for_full_attention_layers(windowed_dirs, arch, monkeypatch):
    """The runner asks for the cuDNN long-prefill path (and its buffers, plans and chunk rules) only
    where some layer has no window: all-windowed Mistral gets length 0 (off), Qwen2's full layer
    keeps it."""
    from pagedserve.attention import gathered_prefill
    asked = []
    monkeypatch.setattr(gathered_prefill, "configure", lambda device, max_len, *a: asked.append(max_len))
    make_runner(windowed_dirs[arch][0], block_size=4)
    assert asked == ([0] if arch == "mistral" else [512])


def test_disable_sliding_window_caps_max_model_len(windowed_dirs):
    """vLLM's --disable-sliding-window: max_model_len at most the smallest window, so no window
    binds and every layer runs the full-attention kernels; asking for more is refused."""
    assert get_max_model_len(MistralConfig(sliding_window=4096), disable_sliding_window=True) == 4096
    qwen2 = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=1024, max_window_layers=2)
    assert get_max_model_len(qwen2, disable_sliding_window=True) == 1024
    plain = MistralConfig(sliding_window=None)
    assert get_max_model_len(plain, disable_sliding_window=True) == plain.max_position_embeddings
    llm = _ours(windowed_dirs["mistral"][0], "cpu", disable_sliding_window=True)
    assert llm.llm_engine.max_model_len == WINDOW
    runner = llm.llm_engine.runner
    assert [m.sliding_window for m in runner.model.modules() if isinstance(m, Attention)] == [0, 0]
    with pytest.raises(ValueError, match="max_model_len"):
        _ours(windowed_dirs["mistral"][0], "cpu", disable_sliding_window=True, max_model_len=WINDOW + 1)
