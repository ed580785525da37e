"""The structured-output benchmark's fixed set of JSON schemas, and which request carries which.

Each schema is an object whose last property is an array with `minItems` far beyond any
workload's output length, so that no grammar can close before max_tokens: a constrained
request then produces exactly as many tokens as the same unconstrained request, and the two
runs' TPOTs differ by the grammar's cost alone. (With dummy weights the logits are noise, so
an unbounded grammar would close within a few tokens.) The schemas vary in what the mask has
to follow: enums, bounded integers and numbers, strings with lengths and patterns, nested
objects, nullable and anyOf items.
"""
from __future__ import annotations

import random
from typing import Any

MIN_ITEMS = 5000

_ITEMS: list[dict[str, Any]] = [
    {"type": "string", "enum": ["red", "green", "blue", "cyan", "magenta"]},
    {"type": "integer", "minimum": -1000, "maximum": 1000},
    {"type": "number"},
    {"type": "boolean"},
    {"type": "string", "maxLength": 12},
    {"type": "string", "pattern": "^[a-z]{2,8}-[0-9]{1,4}$"},
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
     "required": ["x", "y"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                      "ok": {"type": "boolean"}},
     "required": ["name", "ok"], "additionalProperties": False},
    {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 6}]},
    {"type": ["string", "null"], "maxLength": 8},
]

_HEADS: list[dict[str, Any]] = [
    {"id": {"type": "integer", "minimum": 0}},
    {"name": {"type": "string", "maxLength": 24}},
    {"kind": {"type": "string", "enum": ["a", "b", "c"]}},
    {"score": {"type": "number", "minimum": 0, "maximum": 1}},
    {"meta": {"type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"],
              "additionalProperties": False}},
]


def bench_schemas(count: int = 50, seed: int = 0) -> list[dict[str, Any]]:
    """`count` distinct schemas, the same for every call with the same arguments."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    while len(out) < count:
        heads = rng.sample(_HEADS, rng.randint(1, 3))
        item = rng.choice(_ITEMS)
        key = repr((heads, item))
        if key in seen:
            continue
        seen.add(key)
        props: dict[str, Any] = {}
        for h in heads:
            props.update(h)
        props["items"] = {"type": "array", "items": item, "minItems": MIN_ITEMS}
        out.append({"type": "object", "properties": props, "required": list(props),
                    "additionalProperties": False})
    return out


def schema_per_request(num_requests: int, count: int = 50, seed: int = 2) -> list[dict[str, Any]]:
    """The schema each request carries: drawn from the fixed set with random.Random(seed), so two
    engines get the same schema for the same request."""
    schemas = bench_schemas(count)
    rng = random.Random(seed)
    return [rng.choice(schemas) for _ in range(num_requests)]
