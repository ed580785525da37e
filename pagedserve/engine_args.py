"""EngineConfig <-> command-line flags: one --dashed-flag per field, its help from the field.

The config dataclass is the one source of truth: each field's `option(default, help, choices)`
becomes the flag's type, default, choices and help text, so `LLM(...)` and the CLI cannot drift
apart. Both the CLI and the benchmarks import this module; it imports nothing of theirs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from decimal import Decimal, InvalidOperation
from typing import Any

from pagedserve.config import MAX_MODEL_LEN_AUTO, EngineConfig

# model is positional or per-command; extra is not a flag.
SKIPPED_FIELDS = frozenset({"model", "extra"})


def _value_type(annotation: Any) -> type:
    """int for `int`, `int | None` and `Optional[int]`."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return annotation


def engine_fields() -> list[tuple[dataclasses.Field, type]]:
    """The EngineConfig fields that are flags, with their value types."""
    hints = typing.get_type_hints(EngineConfig)
    return [(f, _value_type(hints[f.name])) for f in dataclasses.fields(EngineConfig)
            if f.name not in SKIPPED_FIELDS]


_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """An integer as vLLM's token-count flags read it: 131072, or with a suffix: lower case
    decimal (32k = 32,000, 25.6k = 25,600), upper case binary (128K = 131,072; whole numbers only)."""
    text = text.strip()
    number, suffix = (text[:-1], text[-1]) if text[-1:] in _DECIMAL.keys() | _BINARY.keys() else (text, "")
    try:
        if not suffix:
            return int(number)
        if suffix in _BINARY:
            return int(number) * _BINARY[suffix]
        value = Decimal(number) * _DECIMAL[suffix]  # exact: 16.1k is 16100, not 16100.000000000002
    except (ValueError, InvalidOperation):
        raise argparse.ArgumentTypeError(f"invalid integer {text!r} (e.g. 131072, 32k, 128K)") from None
    if not value.is_finite() or value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
    return int(value)


def human_readable_int_or_auto(text: str) -> int:
    """human_readable_int, or "auto" / -1: MAX_MODEL_LEN_AUTO (vLLM's --max-model-len auto)."""
    return MAX_MODEL_LEN_AUTO if text.strip().lower() in ("auto", "-1") else human_readable_int(text)


# Token counts that take vLLM's human-readable integers on the command line (128K, 32k; auto).
HUMAN_READABLE_FIELDS = {"max_model_len": human_readable_int_or_auto, "max_num_batched_tokens": human_readable_int}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add every EngineConfig field to parser as --dashed-name (bools as --x / --no-x)."""
    group = parser.add_argument_group("engine", "the arguments of LLM(...), as flags")
    for f, kind in engine_fields():
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                               help=help_text)
        elif kind is dict:  # a JSON object: --speculative-config '{"method": "ngram", ...}'
            group.add_argument(flag, type=json.loads, default=f.default, help=help_text)
        elif typing.get_origin(kind) is list:  # list[int]: --flag 1 2 4
            group.add_argument(flag, type=typing.get_args(kind)[0], nargs="+", default=f.default,
                               help=help_text)
        else:
            parse = HUMAN_READABLE_FIELDS.get(f.name, kind)
            group.add_argument(flag, type=parse, default=f.default, help=help_text,
                               choices=f.metadata.get("choices"))


def engine_config_from_args(args: argparse.Namespace, model: str | None) -> EngineConfig:
    """The EngineConfig the parsed flags describe; its own checks raise ValueError."""
    kwargs = {f.name: getattr(args, f.name) for f, _ in engine_fields() if hasattr(args, f.name)}
    return EngineConfig(model=model, **kwargs)


def changed_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Only the flags set to something other than their default, as LLM(...) keyword arguments."""
    cfg = engine_config_from_args(args, model=None)
    return {f.name: getattr(cfg, f.name) for f, _ in engine_fields()
            if getattr(cfg, f.name) != f.default}
