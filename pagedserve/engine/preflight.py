"""The checks of an EngineConfig that need no engine, run by `pagedserve serve` before it starts
any process: a mistake costs the user two seconds and one line, not the engine core's start-up
(tens of seconds) and its error printed by both processes.

Each error is one line naming the path or flag and what is wrong. The engine repeats the same
checks (LLMEngine.__init__), so the Python API gives the same messages; this module only moves
them earlier. Nothing here initialises CUDA (torch.cuda.is_available and device_count read NVML).
"""
from __future__ import annotations

import os

from pagedserve.config import MAX_MODEL_LEN_AUTO, EngineConfig

# Any of these makes a directory loadable by AutoTokenizer (fast tokenizer, sentencepiece, BPE vocab).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "tiktoken.model")


def check_tokenizer_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise ValueError(f"tokenizer: {path!r} is not a local directory (pagedserve loads local HF directories; "
                         "there is no model-hub download)")
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise ValueError(f"tokenizer: no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {path!r} "
                         "(--tokenizer DIR names another directory; --skip-tokenizer-init loads none)")


def _cuda_driver_loadable() -> bool:
    import ctypes
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


def check_device(device: str) -> None:
    if not device.startswith("cuda"):
        return  # "auto" and "cpu" always resolve; anything else is refused by EngineConfig
    # Without the driver library there is no CUDA: said at once, without importing torch (seconds).
    if not _cuda_driver_loadable():
        raise ValueError(f"device: --device {device} but CUDA is not available on this machine (no CUDA driver; "
                         "--device cpu, or auto: CUDA when there is one)")
    import torch
    if not torch.cuda.is_available():
        raise ValueError(f"device: --device {device} but CUDA is not available on this machine "
                         "(--device cpu, or auto: CUDA when there is one)")
    index = device.partition(":")[2]
    if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
        raise ValueError(f"device: --device {device} but this machine has {torch.cuda.device_count()} CUDA device(s)")


def check_engine_config(config: EngineConfig) -> None:
    """Raise ValueError (one line) for what would make the engine fail to start. Reads files only:
    no torch or transformers import unless a CUDA device is asked for."""
    from types import SimpleNamespace

    from pagedserve.models.hf_dir import apply_hf_overrides, get_max_model_len, read_config_json, safetensors_files

    raw = read_config_json(config.model)  # a local directory holding a readable config.json
    if config.load_format != "dummy":
        safetensors_files(config.model)
    if not config.skip_tokenizer_init:
        check_tokenizer_dir(config.tokenizer or config.model)
    if config.max_model_len != MAX_MODEL_LEN_AUTO:
        try:
            model_max = get_max_model_len(apply_hf_overrides(SimpleNamespace(**raw), config.hf_overrides,
                                                             strict=False), config.disable_sliding_window)
        except (ValueError, KeyError, TypeError, AttributeError):
            model_max = None  # no limit in config.json, or RoPE fields it lacks: the engine's check decides
        if config.max_model_len is not None and model_max is not None and config.max_model_len > model_max:
            raise ValueError(f"max_model_len: --max-model-len {config.max_model_len} is beyond the model's limit "
                             f"of {model_max} tokens ({os.path.join(config.model, 'config.json')})")
        max_model_len = config.max_model_len or model_max
        if max_model_len:
            # SchedulerConfig's own checks (a step budget below max_model_len without chunked
            # prefill...), made here so that they fail before the engine loads the model.
            config.scheduler_config(max_model_len)
    check_device(config.device)
