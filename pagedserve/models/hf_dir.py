"""A local HF model directory, checked without torch or transformers: its config.json, its
context limit and its safetensors files. `pagedserve serve` runs these before any process
starts (engine/preflight.py); the loader (loader.py) runs them again and then builds the model.
"""
from __future__ import annotations

import glob
import json
import os

PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
SAFETENSORS_INDEX = "model.safetensors.index.json"


def read_config_json(model_dir: str | os.PathLike) -> dict:
    """config.json of a local directory as a dict; a ValueError of one line naming the path otherwise."""
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise ValueError(f"model: {model_dir!r} is not a local directory (pagedserve loads local HF directories; "
                         "there is no model-hub download)")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model: no config.json in {model_dir!r}")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"model: {path} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"model: {path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def get_max_model_len(hf_config) -> int:
    """The longest context the model supports: its position limit (and Mistral's sliding window,
    which our kernels do not implement, so longer contexts would be silently wrong)."""
    limit = None
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            limit = value
            break
    if limit is None:
        raise ValueError("cannot find the model's maximum length in its config; pass max_model_len")
    window = getattr(hf_config, "sliding_window", None)
    uses_window = getattr(hf_config, "use_sliding_window", True)
    if isinstance(window, int) and window > 0 and uses_window:
        limit = min(limit, window)
    return limit


def safetensors_files(model_dir: str | os.PathLike) -> list[str]:
    """The checkpoint's safetensors files (from the index when sharded); refuses pickled checkpoints."""
    model_dir = os.fspath(model_dir)
    index = os.path.join(model_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"{SAFETENSORS_INDEX} lists missing shard(s): {[os.path.basename(m) for m in missing]}")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if files:
        return files
    pickled = sorted(os.path.basename(p) for pat in PICKLE_PATTERNS for p in glob.glob(os.path.join(model_dir, pat)))
    if pickled:
        raise ValueError(f"model: {model_dir!r} holds only pickled checkpoint(s) {pickled}; pagedserve never loads "
                         "pickles (they can run arbitrary code). Convert them to safetensors, e.g. "
                         "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)")
    raise ValueError(f"model: no *.safetensors weights in {model_dir!r} (for random weights: --load-format dummy on the "
                     "command line, load_format='dummy' in LLM(...))")
