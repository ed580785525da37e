"""`pagedserve serve | generate | bench | sim`.

Each subcommand lives in its own module and is imported only when used, so
`pagedserve sim` starts without torch.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from pagedserve.config import EngineConfig

_SKIP_FIELDS = {"model", "extra"}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One --dashed-flag per EngineConfig field, so the CLI mirrors LLM(...)."""
    for f in dataclasses.fields(EngineConfig):
        if f.name in _SKIP_FIELDS:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif f.name in ("num_gpu_blocks_override", "max_num_batched_tokens", "max_model_len"):
            parser.add_argument(flag, type=int, default=None)
        elif f.name == "tokenizer":
            parser.add_argument(flag, type=str, default=None)
        else:
            parser.add_argument(flag, type=type(default), default=default)


def engine_config_from_args(args: argparse.Namespace, model: str | None) -> EngineConfig:
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
              if f.name not in _SKIP_FIELDS and hasattr(args, f.name)}
    return EngineConfig(model=model, **kwargs)


def main(argv: list[str] | None = None) -> int:
    from pagedserve.runner.dist_env import is_external_worker
    if is_external_worker():
        # torchrun started this command on every node: ranks > 0 serve rank 0's engine instead.
        from pagedserve.runner.launch import main as worker_main
        return worker_main()
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    from pagedserve.entrypoints import commands
    for name in ("serve", "generate", "bench", "sim"):
        getattr(commands, f"register_{name}")(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"pagedserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
