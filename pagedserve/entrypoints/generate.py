"""`pagedserve generate`: complete prompts given on the command line and print the results."""
from __future__ import annotations

import argparse
import sys


def _default_model() -> str:
    try:
        from pagedserve.demo_model import DEMO_MODEL_DIR
    except ImportError as e:
        raise ValueError("--model is required: the bundled demo model (pagedserve.demo_model) "
                         f"is not available ({e})") from e
    return str(DEMO_MODEL_DIR)


def run_generate_cli(args: argparse.Namespace) -> int:
    from pagedserve.engine_args import engine_config_from_args
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    model = args.model or _default_model()
    config = engine_config_from_args(args, model)
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=None if args.temperature == 0 else config.seed)
    llm = LLM.from_engine_config(config)
    outputs = llm.generate(args.prompts, params, use_tqdm=False)
    for out in outputs:
        for c in out.outputs:
            label = f"[{c.index}] " if len(out.outputs) > 1 else ""
            print(f"{out.prompt!r} -> {label}{c.text!r}  ({len(c.token_ids)} tokens, {c.finish_reason})")
    sys.stdout.flush()
    return 0
