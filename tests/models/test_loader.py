"""Loader: refuses pickles and unknown architectures; dummy weights build real configs with HF's shapes."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from pagedserve.models.loader import get_max_model_len, get_model, load_hf_config, resolve_dtype
from pagedserve.models.registry import supported_architectures

# The real models' configs ship with the repo, beside the benchmarks that use them.
REAL = Path(__file__).resolve().parents[2] / "benchmarks" / "models"


def test_pickled_checkpoint_refused(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    torch.save({"x": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    cfg = load_hf_config(tmp_path)
    with pytest.raises(ValueError, match=r"pickle.*pytorch_model\.bin.*safetensors"):
        get_model(cfg, model_dir=tmp_path, device=torch.device("cpu"), dtype=torch.float32)


def test_unknown_architecture_refused(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FancyNewForCausalLM") as e:
        get_model(load_hf_config(tmp_path), model_dir=tmp_path, device=torch.device("cpu"), dtype=torch.float32,
                  load_format="dummy")
    for arch in supported_architectures():
        assert arch in str(e.value)


def test_missing_directory_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="not a local directory"):
        load_hf_config(tmp_path / "nope")


def _shrunk(name):
    cfg = load_hf_config(f"{REAL}/{name}")
    cfg.num_hidden_layers = 1
    cfg.vocab_size = 1000
    if cfg.model_type == "opt":
        cfg.hidden_size, cfg.ffn_dim, cfg.word_embed_proj_dim, cfg.num_attention_heads = 80, 160, 80, 5
    else:
        cfg.hidden_size, cfg.intermediate_size = 64, 96
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 4, 2, 32
    return cfg


def _expected_shapes(model, cfg):
    """HF's parameter shapes (meta device), with q/k/v and gate/up fused as our model fuses them."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
    shapes = {}
    for name, p in hf.named_parameters():
        shape = tuple(p.shape)
        for fused, ckpt, _ in model.stacked_params:
            if f".{ckpt}." in name:
                name = name.replace(f".{ckpt}.", f".{fused}.")
                if name in shapes:
                    shape = (shapes[name][0] + shape[0], *shape[1:])
                break
        shapes[name] = shape
    return shapes


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3.1-8b", "opt-13b"])
def test_dummy_load_real_configs(name):
    cfg = _shrunk(name)
    model = get_model(cfg, model_dir=None, device=torch.device("cpu"), dtype=torch.float32, load_format="dummy",
                      seed=3)
    ours = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert ours == _expected_shapes(model, cfg)
    again = get_model(cfg, model_dir=None, device=torch.device("cpu"), dtype=torch.float32, load_format="dummy",
                      seed=3)
    for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n
    assert any(p.std() > 0 for p in model.parameters() if p.dim() == 2)


@pytest.mark.parametrize("name", ["qwen3-0.6b", "opt-13b"])
def test_dummy_model_runs_through_runner(name):
    from pagedserve.config import EngineConfig
    from pagedserve.core.plan import ScheduledSequence, SchedulerOutput
    from pagedserve.runner.model_runner import ModelRunner
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.sequence import Sequence, SequenceGroup

    cfg = _shrunk(name)
    ec = EngineConfig(load_format="dummy", block_size=8, cpu_kv_cache_gib=0.002, swap_space=0.001)
    runner = ModelRunner(ec, cfg, torch.device("cpu"), torch.float32)
    runner.load_model()
    num_gpu, num_cpu = runner.determine_num_blocks()
    assert num_gpu == int(0.002 * 2**30) // runner.block_bytes and num_cpu == int(0.001 * 2**30) // runner.block_bytes
    runner.init_kv_cache(num_gpu, num_cpu)
    seq = Sequence(prompt_token_ids=list(range(1, 20)))
    group = SequenceGroup("r", [seq], SamplingParams())
    logits = runner.execute(SchedulerOutput(scheduled=[ScheduledSequence(seq, group, 0, 19, [5, 0, 9])]))
    assert logits.shape == (1, runner.vocab_size) and torch.isfinite(logits).all()


def test_max_model_len_and_dtype():
    llama = load_hf_config(f"{REAL}/llama-3.1-8b")
    opt = load_hf_config(f"{REAL}/opt-13b")
    assert get_max_model_len(llama) == 131072 and get_max_model_len(opt) == 2048
    assert resolve_dtype("auto", llama, "cpu") == torch.float32
    assert resolve_dtype("auto", llama, "cuda") == torch.bfloat16
    assert resolve_dtype("auto", opt, "cuda") == torch.float16
    assert resolve_dtype("half", llama, "cpu") == torch.float16


def test_fused_checkpoint_tensors_split_by_rows_and_scales_refused():
    """Phi-3's fused q/k/v: cut into the parts stacked_params knows, each a lazy window of rows (a
    safetensors slice reads only the rows asked for); a fused FP8 scale or a wrong row count refused."""
    from pagedserve.layers.weights import RowWindow
    from pagedserve.models.loader import split_fused_tensors

    class Phi3Like:
        def checkpoint_row_splits(self):
            return {"qkv_proj": [("q_proj", 4), ("k_proj", 2), ("v_proj", 2)]}

    class Lazy:  # a safetensors slice of an [8, 3] tensor that records what it reads
        def __init__(self):
            self.t, self.reads = torch.arange(24.0).view(8, 3), []

        def get_shape(self):
            return list(self.t.shape)

        def get_dtype(self):
            return "F32"

        def __getitem__(self, index):
            self.reads.append(index)
            return self.t[index]

    fused = Lazy()
    parts = dict(split_fused_tensors(Phi3Like(), [("m.layers.0.self_attn.qkv_proj.weight", fused),
                                                  ("m.layers.0.mlp.down_proj.weight", "untouched")]))
    assert list(parts) == [f"m.layers.0.self_attn.{p}_proj.weight" for p in "qkv"] + ["m.layers.0.mlp.down_proj.weight"]
    k = parts["m.layers.0.self_attn.k_proj.weight"]
    assert isinstance(k, RowWindow) and k.get_shape() == [2, 3] and fused.reads == []
    torch.testing.assert_close(k[1:2], fused.t[5:6])  # one row of the part: one row read
    assert fused.reads == [(slice(5, 6), )]
    torch.testing.assert_close(parts["m.layers.0.self_attn.v_proj.weight"][:], fused.t[6:8])
    assert parts["m.layers.0.mlp.down_proj.weight"] == "untouched"
    tensor_parts = dict(split_fused_tensors(Phi3Like(), [("a.qkv_proj.weight", torch.ones(8, 3))]))
    assert tensor_parts["a.q_proj.weight"].shape == (4, 3)
    with pytest.raises(ValueError, match=r"a\.qkv_proj\.weight_scale: quantized checkpoints that fuse qkv_proj"):
        list(split_fused_tensors(Phi3Like(), [("a.qkv_proj.weight_scale", torch.ones(()))]))
    with pytest.raises(ValueError, match=r"7 rows, expected 8 \(q_proj 4 \+ k_proj 2 \+ v_proj 2\)"):
        list(split_fused_tensors(Phi3Like(), [("a.qkv_proj.weight", torch.ones(7, 3))]))
