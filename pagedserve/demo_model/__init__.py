"""The demo model bundled with pagedserve: a ~2M-parameter Llama trained on the King James Bible.

`DEMO_MODEL_DIR` is an ordinary HF model directory (config.json, model.safetensors, tokenizer
files) inside the installed package, so the CLI and tests can run with no download. README.md
beside this file says how it was made; scripts/train_demo_model.py remakes it.
"""
from __future__ import annotations

import json
from pathlib import Path

DEMO_MODEL_DIR: Path = Path(__file__).resolve().parent


def demo_eval_record() -> dict:
    """eval.json: the held-out perplexity measured after training and the bound tests assert."""
    return json.loads((DEMO_MODEL_DIR / "eval.json").read_text())


__all__ = ["DEMO_MODEL_DIR", "demo_eval_record"]
