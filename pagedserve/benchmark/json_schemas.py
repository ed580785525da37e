"""The structured-output benchmarks' fixed sets of JSON Schemas (#32: "every request carries a
json_schema drawn from a fixed set of 50").

benchmark_schemas: deterministic (seeded) and varied the way real response_format schemas are:
flat and nested objects, bounded strings, integer / number bounds, enums, arrays with minItems /
maxItems, nullable fields, patterns and formats; closed (additionalProperties false) as OpenAI's
strict mode requires. The host-side mask cost (benchmarks/kernels/structured_mask_cost.py) uses them.

serving_schemas: the same 50, each with one more required property, an array of small items whose
minItems is far beyond any workload's output length, so that no grammar can close before
max_tokens. The serving side by side (benchmarks/serving/structured_vs_vllm.py) uses them: a constrained
request then produces as many tokens as the same unconstrained one, and the two runs' TPOTs differ
by the grammar's cost alone (with dummy weights the logits are noise, so a schema that may close
closes within a few tokens).
"""
from __future__ import annotations

import random

MIN_ITEMS = 5000

_WORDS = ["title", "author", "year", "rating", "tags", "summary", "price", "city", "country", "email",
          "score", "level", "status", "items", "count", "name", "id", "date", "active", "notes",
          "kind", "owner", "color", "size", "weight", "label", "code", "url", "phone", "priority"]

# The items of serving_schemas' long array, one per schema in turn.
_TAIL_ITEMS: list[dict] = [
    {"type": "string", "enum": ["red", "green", "blue", "cyan", "magenta"]},
    {"type": "integer", "minimum": -1000, "maximum": 1000},
    {"type": "number"},
    {"type": "boolean"},
    {"type": "string", "maxLength": 12},
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
     "required": ["x", "y"], "additionalProperties": False},
    {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 6}]},
]


def _leaf(rng: random.Random, depth: int) -> dict:
    r = rng.randrange(10 if depth < 2 else 8)
    if r == 0:
        return {"type": "string", "maxLength": rng.choice([8, 16, 32, 64])}
    if r == 1:
        lo = rng.randrange(0, 100)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.choice([9, 99, 9999])}
    if r == 2:
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 100, 1e6])}
    if r == 3:
        return {"type": "boolean"}
    if r == 4:
        return {"type": "string", "enum": rng.sample(_WORDS, rng.randint(2, 6))}
    if r == 5:
        return {"type": ["string", "null"], "maxLength": 24}
    if r == 6:
        return {"type": "string", "pattern": rng.choice([r"^[A-Z]{3}-[0-9]{4}$", r"^[a-z]+(_[a-z]+)*$",
                                                         r"^\+?[0-9]{7,12}$"])}
    if r == 7:
        return {"type": "string", "format": rng.choice(["date", "email", "uuid", "date-time", "ipv4"])}
    if r == 8:
        return {"type": "array", "items": _leaf(rng, depth + 1), "minItems": rng.randint(0, 2),
                "maxItems": rng.randint(3, 6)}
    return _object(rng, depth + 1)


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(_WORDS, rng.randint(2, 6 if depth == 0 else 4))
    props = {n: _leaf(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.8] or names[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def benchmark_schemas(n: int = 50, seed: int = 0) -> list[dict]:
    """n JSON Schemas, the same for the same (n, seed)."""
    rng = random.Random(seed)
    return [_object(rng, 0) for _ in range(n)]


def serving_schemas(n: int = 50, seed: int = 0) -> list[dict]:
    """benchmark_schemas(n, seed), each required to end in a MIN_ITEMS-long array ("zz_tail",
    last in property order, so the varied part is generated first)."""
    out = []
    for i, s in enumerate(benchmark_schemas(n, seed)):
        tail = {"type": "array", "items": _TAIL_ITEMS[i % len(_TAIL_ITEMS)], "minItems": MIN_ITEMS}
        out.append({**s, "properties": {**s["properties"], "zz_tail": tail},
                    "required": [*s["required"], "zz_tail"]})
    return out


def schema_per_request(num_requests: int, count: int = 50, seed: int = 2) -> list[dict]:
    """The serving schema each request carries: drawn from serving_schemas(count) with
    random.Random(seed), so two engines get the same schema for the same request."""
    schemas = serving_schemas(count)
    rng = random.Random(seed)
    return [rng.choice(schemas) for _ in range(num_requests)]


def response_format(schema: dict, index: int) -> dict:
    """OpenAI's response_format for a schema (strict json_schema), as a benchmark client sends it."""
    return {"type": "json_schema", "json_schema": {"name": f"bench_{index}", "schema": schema, "strict": True}}
