"""The MoE layer shapes the kernel benchmarks and the tuner use: (experts, hidden, intermediate per
rank, top_k) from a model's config.json (benchmarks/models/<name>) at a tensor-parallel size."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pagedserve.benchmark.roofline import moe_shape  # noqa: E402
from pagedserve.models.loader import load_hf_config  # noqa: E402

MODELS = ("qwen3-30b-a3b", "mixtral-8x7b")
# vLLM's token counts for its tuned tables: decode batches up to prefill chunks.
TOKEN_COUNTS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)


def layer_shape(model: str, tp: int = 1, expert_parallel: bool = False) -> tuple[int, int, int, int]:
    """(experts per rank, hidden, intermediate per rank, top_k): tensor parallelism splits the
    intermediate dimension, expert parallelism the experts."""
    path = Path(model) if Path(model).is_dir() else ROOT / "benchmarks" / "models" / model
    cfg = load_hf_config(path)
    experts, top_k, inter, _, _ = moe_shape(cfg)
    if not experts:
        raise ValueError(f"{path} is not a mixture of experts")
    if expert_parallel:
        if experts % tp:
            raise ValueError(f"{experts} experts are not divisible by tp {tp}")
        return experts // tp, cfg.hidden_size, inter, top_k
    if inter % tp:
        raise ValueError(f"intermediate size {inter} is not divisible by tp {tp}")
    return experts, cfg.hidden_size, inter // tp, top_k
