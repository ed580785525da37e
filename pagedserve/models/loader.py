"""Build a model from a local HF directory: config via AutoConfig, weights streamed from safetensors.

Weights are read one tensor at a time with safe_open and handed to the owning parameter's
weight_loader as a lazy slice, so a tensor-parallel rank reads only its own part. Pickled
checkpoints are never loaded; remote code is never run; nothing is fetched from a hub.
"""
from __future__ import annotations

import inspect
import logging
import os
import re
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
from torch import nn

from pagedserve.layers.quant.base import QuantizationConfig
from pagedserve.layers.quant.fusion import fuse_activation_quant
from pagedserve.layers.weights import default_weight_loader, loaded_shape, materialize, rows_of
from pagedserve.models.registry import get_model_class

# Re-exported: the torch-free checks of a model directory live in hf_dir.py (preflight uses them).
from pagedserve.models.hf_dir import (PICKLE_PATTERNS, SAFETENSORS_INDEX, apply_hf_overrides,  # noqa: F401
                                      get_max_model_len, read_config_json, safetensors_files, text_decoder_view)

logger = logging.getLogger(__name__)


def load_hf_config(model_dir: str | os.PathLike, overrides: dict | None = None):
    """The model's PretrainedConfig, from a local directory only (no hub, no remote code), with
    EngineConfig.hf_overrides applied (hf_dir.apply_hf_overrides)."""
    from transformers import AutoConfig

    model_dir = os.fspath(model_dir)
    read_config_json(model_dir)  # one line naming the spot for a missing or broken file, not HF's traceback
    path = os.path.join(model_dir, "config.json")
    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False, local_files_only=True)
    except (OSError, KeyError) as e:
        raise ValueError(f"model: {path} could not be read as a transformers config ({e})") from None
    return apply_hf_overrides(text_decoder_view(config), overrides)


_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype, hf_config, device: torch.device | str) -> torch.dtype:
    """"auto": float32 on CPU; on CUDA float16 if the checkpoint is float16, else bfloat16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {dtype!r}")
        return _DTYPES[dtype]
    if torch.device(device).type == "cpu":
        return torch.float32
    cfg = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if cfg in (torch.float16, "float16"):
        return torch.float16
    return torch.bfloat16


@contextmanager
def _building_on(device: torch.device, dtype: torch.dtype):
    """Parameters created inside are allocated directly on `device` in `dtype` (no CPU detour)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def iterate_safetensors(model_dir: str | os.PathLike) -> Iterator[tuple[str, object]]:
    """(name, lazy slice) for every tensor, one file open at a time."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.(\w+)\.(weight|weight_scale|input_scale)$")


def _expert_target(model: nn.Module, name: str) -> tuple[str, int, str] | None:
    """(fused parameter name, expert id, shard id) for one expert's checkpoint tensor of a
    mixture-of-experts model (expert_checkpoint_names: checkpoint module -> w1 | w2 | w3): its
    weight, or an FP8 checkpoint's weight_scale / input_scale (-> w13_weight_scale, ...)."""
    names = getattr(model, "expert_checkpoint_names", None)
    m = _EXPERT_TENSOR.search(name) if names else None
    if m is None or m.group(2) not in names:
        return None
    shard = names[m.group(2)]
    fused = f"{'w2' if shard == 'w2' else 'w13'}_{m.group(3)}"
    return f"{name[:m.start()]}.experts.{fused}", int(m.group(1)), shard


def kv_scale_target(name: str) -> tuple[str, str] | None:
    """A checkpoint's KV-cache scale (model.layers.N.self_attn[.k_proj].k_scale, as
    compressed-tensors and ModelOpt write it) -> (the Attention module that holds it, "k" | "v")."""
    for kind in ("k", "v"):
        if name.endswith(f".{kind}_scale") and ".self_attn." in name:
            return name.split(".self_attn.")[0] + ".self_attn.attn", kind
    return None


def _is_fp8(w) -> bool:
    """A checkpoint tensor (or lazy safetensors slice) stored in an 8-bit float format."""
    if isinstance(w, torch.Tensor):
        return w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    return str(w.get_dtype()).startswith("F8")


def split_fused_tensors(model: nn.Module, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
    """A checkpoint that fuses what our linears load by part (Phi-3's qkv_proj and gate_up_proj:
    model.checkpoint_row_splits()) as those parts, each a lazy window of the fused tensor's rows.
    A quantized fused tensor's scales are refused: they would not split by rows."""
    splits = model.checkpoint_row_splits() if hasattr(model, "checkpoint_row_splits") else {}
    for name, w in weights:
        fused = next((f for f in splits if f".{f}." in name), None)
        if fused is None:
            yield name, w
            continue
        parts = splits[fused]
        if not name.endswith((".weight", ".bias")):
            raise ValueError(f"loading {name}: quantized checkpoints that fuse {fused} are not supported "
                             f"({type(model).__name__}); load the unquantized checkpoint")
        total = sum(rows for _, rows in parts)
        if loaded_shape(w)[0] != total:
            raise ValueError(f"loading {name}: {loaded_shape(w)[0]} rows, expected {total} "
                             f"({' + '.join(f'{p} {r}' for p, r in parts)})")
        start = 0
        for part, rows in parts:
            yield name.replace(f".{fused}.", f".{part}."), rows_of(w, start, rows)
            start += rows


def load_weights(model: nn.Module, weights: Iterable[tuple[str, object]]) -> None:
    """Route each checkpoint tensor to its parameter's weight_loader (fusing q/k/v and gate/up,
    and each expert's tensors into its MoE layer's [E, ...] parameters).

    KV-cache scales go to the Attention modules' k_scale / v_scale buffers (used only with an
    fp8 KV cache): one number per layer, or one per KV head, sharded by KV head under tensor
    parallelism as k_proj / v_proj are (Attention.load_kv_scale)."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    stacked = getattr(model, "stacked_params", [])
    renames = getattr(model, "checkpoint_renames", ())
    skips = getattr(model, "checkpoint_skips", ())  # parts of the checkpoint the model does not serve
    tied = getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" not in params
    loaded: set[str] = set()
    expert_parts: dict[str, set[tuple[int, str]]] = {}
    for name, w in split_fused_tensors(model, weights):
        if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight") or any(s in name for s in skips):
            continue
        for old, new in renames:
            name = name.replace(old, new)
        scale_target = kv_scale_target(name)
        if scale_target is not None:
            attn = modules.get(scale_target[0])
            if attn is not None and hasattr(attn, "load_kv_scale"):
                try:
                    attn.load_kv_scale(scale_target[1], materialize(w))
                except ValueError as e:
                    raise ValueError(f"loading {name}: {e}") from None
            continue
        target = _expert_target(model, name)
        if target is not None:
            pname, expert, shard_id = target
            param = params.get(pname)
            if param is None:
                logger.warning("checkpoint tensor %s has no matching parameter; skipped", name)
                continue
            try:
                mine = param.weight_loader(param, w, shard_id, expert)
            except ValueError as e:
                raise ValueError(f"loading {name}: {e}") from None
            if mine is not False:  # False: another rank's expert (expert parallelism)
                expert_parts.setdefault(pname, set()).add((expert, shard_id))
            continue
        shard = None
        for fused, ckpt, shard_id in stacked:
            if f".{ckpt}." in name:
                name, shard = name.replace(f".{ckpt}.", f".{fused}."), shard_id
                break
        param = params.get(name)
        if param is None:
            if name == "lm_head.weight":  # tied: the checkpoint repeats the embedding
                continue
            logger.warning("checkpoint tensor %s has no matching parameter; skipped", name)
            continue
        if _is_fp8(w) and param.element_size() != 1:
            raise ValueError(f"loading {name}: the checkpoint's tensor is FP8 but pagedserve keeps this layer in the "
                             "model dtype (routers and Qwen2-MoE's shared_expert_gate are never quantized); "
                             "its quantization_config must ignore it")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, w, shard) if shard is not None else loader(param, w)
        except ValueError as e:
            raise ValueError(f"loading {name}: {e}") from None
        loaded.add(name)
    for pname, parts in expert_parts.items():
        # every (expert, shard) this rank holds: E_local x (gate and up | down), unless the
        # parameter says otherwise (a static input scale reads every expert's)
        expected = getattr(params[pname], "num_expert_parts", None)
        if expected is None:
            expected = params[pname].shape[0] * (2 if ".experts.w13_" in pname else 1)
        if len(parts) == expected:
            loaded.add(pname)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} parameter(s), e.g. {missing[:5]}")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic random weights on the parameters' own device: matrices ~ N(0, std),
    norm scales 1, biases 0 — so activations stay finite through any depth."""
    gen = None
    for name, p in model.named_parameters():
        if gen is None:
            gen = torch.Generator(device=p.device).manual_seed(seed)
        if p.dim() >= 2:
            if p.dtype.is_floating_point and p.element_size() == 1:  # an fp8 checkpoint's weight
                p.copy_(torch.empty(p.shape, device=p.device).normal_(0.0, std, generator=gen))
            else:
                p.normal_(0.0, std, generator=gen)
        elif name.endswith("norm.weight") or name.endswith("_scale"):
            p.fill_(1.0)
        else:
            p.zero_()


def get_model(hf_config, *, model_dir: str | os.PathLike | None, device: torch.device, dtype: torch.dtype,
              load_format: str = "auto", seed: int = 0, tp_rank: int = 0, tp_size: int = 1,
              expert_parallel: bool = False, quant_config: QuantizationConfig | None = None,
              max_model_len: int | None = None) -> nn.Module:
    """Instantiate config.architectures[0] on `device` in `dtype` and fill its weights.
    expert_parallel: whole experts per rank in mixture-of-experts layers (MoE models only); with a
    quant_config, its linear layers are quantized (layers/quant) once every tensor is in;
    max_model_len: the engine's, for the families whose RoPE depends on it (LongRoPE's factors)."""
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"load_format must be auto, safetensors or dummy, got {load_format!r}")
    cls = get_model_class(hf_config)
    kwargs = {}
    if expert_parallel:
        if not getattr(cls, "supports_expert_parallel", False):
            raise ValueError(f"enable_expert_parallel: {cls.__name__} is not a mixture of experts")
        kwargs["expert_parallel"] = True
    files = None
    if load_format != "dummy":
        if model_dir is None:
            raise ValueError("model: a directory is required unless load_format='dummy'")
        files = safetensors_files(model_dir)  # fail before allocating anything
    device = torch.device(device)
    if quant_config is not None:
        if "quant_config" not in inspect.signature(cls.__init__).parameters:
            raise ValueError(f"quantization {quant_config.name}: {cls.__name__} has no quantized layers in "
                             "pagedserve (the Llama family and its mixtures of experts have)")
        quant_config.check_device(device)
        kwargs["quant_config"] = quant_config
    if max_model_len is not None and "max_model_len" in inspect.signature(cls.__init__).parameters:
        kwargs["max_model_len"] = max_model_len
    with _building_on(device, dtype):
        model = cls(hf_config, tp_rank=tp_rank, tp_size=tp_size, **kwargs)
    model.to(device)  # buffers made on CPU (rotary inv_freq) follow the parameters
    if files is None:
        init_dummy_weights(model, seed)
    else:
        load_weights(model, iterate_safetensors(model_dir))
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    if quant_config is not None:
        fuse_activation_quant(model)
    return model.eval()
