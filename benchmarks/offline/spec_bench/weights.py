"""The one checkpoint both engines load, and the fingerprint that says which weights a part ran.

Why: with load_format "dummy" each engine fills the config with its own random weights (vLLM uniform
+-1e-3 everywhere, norms included: degenerate repeating text, so n-gram acceptance near 1; ours N(0,
0.02) matrices and norms 1: varied text), so the two sides measured different models. The checkpoint
section writes the bench's model config ONCE as a safetensors checkpoint in HF layout, with HF's own
initialisation (transformers' from_config: N(0, initializer_range) matrices and embeddings, norms 1),
seeded, built on the GPU when there is one; both engines then load it (load_format auto), target and
draft alike.

Invariants:
- A checkpoint directory appears whole or not at all: it is written under a temporary name beside it
  (DIR.partialPID) and renamed at the end, so a run killed half-way leaves nothing a later run would
  take for it; the next writer removes such leftovers (one writer at a time).
- weights_record() uses the standard library only (the vLLM process computes it too) and reads at
  most 1 MiB of weights: a dummy run is {"load_format": "dummy", ...}; a checkpoint run names the
  directory, the config it was built from, its seed, and sha256s of its config.json and of the first
  MiB of its first shard (the safetensors header and the first tensor's leading bytes: another seed
  or another config gives another hash). Two parts ran the same weights iff their records are equal.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

INFO = "spec_bench_checkpoint.json"  # beside the weights: what the checkpoint was built from
# Files of the model directory that are not weights, copied over HF's own where it wrote them. config.json
# too: the original, in the format both engines' transformers already read (transformers 5 rewrites
# it in its own: dtype for torch_dtype, rope_parameters for rope_scaling), from which the weights were built.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
              "chat_template.jinja")
MIB = 1 << 20
SHARD_SIZE = "5GB"  # transformers 5 would write one 16 GB file by default; 4.x wrote 5 GB shards


def _sha256(path: Path, limit: int | None = None) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(limit) if limit else f.read()).hexdigest()


def shard_files(weights_dir: str | os.PathLike) -> list[Path]:
    """The checkpoint's safetensors files in order (the index's when sharded), as the loaders see them."""
    d = Path(weights_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return [d / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [Path(p) for p in sorted(glob.glob(str(d / "*.safetensors")))]


def weights_record(weights_dir: str | os.PathLike | None, model_dir: str | os.PathLike) -> dict:
    """Which weights a part ran: dummy ones in model_dir's config (weights_dir None), or the checkpoint
    in weights_dir (module docstring)."""
    if weights_dir is None:
        return {"load_format": "dummy", "model": Path(model_dir).name,
                "config_sha256": _sha256(Path(model_dir) / "config.json")}
    d = Path(weights_dir)
    shards = shard_files(d)
    if not shards or not (d / "config.json").is_file():
        raise SystemExit(f"--weights {d}: no config.json and *.safetensors there (the checkpoint section writes them)")
    info = json.loads((d / INFO).read_text()) if (d / INFO).is_file() else {}
    # A checkpoint written elsewhere (no INFO): its own directory names the model.
    return {"load_format": "auto", "dir": d.name, "model": info.get("model", d.name), "seed": info.get("seed"),
            "config_sha256": _sha256(d / "config.json"), "first_shard": shards[0].name,
            "first_shard_mib_sha256": _sha256(shards[0], MIB)}


def write_checkpoint(model_dir: str | os.PathLike, out_dir: str | os.PathLike, seed: int = 0,
                     device: str = "auto") -> dict:
    """Write model_dir's config as a safetensors checkpoint in out_dir (which must not exist): HF's
    initialisation, seeded, in the config's dtype (bf16 for the bench's Llama), built on `device`
    ("auto": CUDA when there is one). Returns its weights_record plus the seconds it took."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if out_dir.exists():
        raise SystemExit(f"--weights {out_dir} exists: the checkpoint section writes a new directory "
                         "(remove it to write it again)")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    cfg = AutoConfig.from_pretrained(model_dir)
    dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or torch.bfloat16
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    # transformers 5 names the argument dtype; 4.x torch_dtype (the project allows >= 4.50).
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    torch.manual_seed(seed)  # every device's generator: the init draws on `device`
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, **{dtype_kw: dtype})
    built = time.perf_counter() - t0
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # One writer at a time: what an earlier, killed writer left (16 GB for the 8B) goes first.
    for stale in glob.glob(glob.escape(str(out_dir)) + ".partial*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out_dir.with_name(out_dir.name + f".partial{os.getpid()}")
    save_kw = {"max_shard_size": SHARD_SIZE}
    if dtype_kw == "torch_dtype":
        save_kw["safe_serialization"] = True  # 4.x's default too; 5 writes only safetensors
    model.save_pretrained(tmp, **save_kw)
    del model
    for name in SIDE_FILES:
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, tmp / name)
    info = {"model": model_dir.name, "seed": seed, "init": "transformers AutoModelForCausalLM.from_config",
            "transformers": transformers.__version__, "dtype": str(dtype).removeprefix("torch."), "device": device}
    (tmp / INFO).write_text(json.dumps(info, indent=1) + "\n")
    os.replace(tmp, out_dir)
    size = sum(f.stat().st_size for f in shard_files(out_dir))
    return {**weights_record(out_dir, model_dir), "bytes": size, "build_seconds": round(built, 1),
            "seconds": round(time.perf_counter() - t0, 1)}
