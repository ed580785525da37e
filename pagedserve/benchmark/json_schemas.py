"""A fixed set of JSON Schemas for structured-output benchmarks (issue #32: "every request carries
a json_schema drawn from a fixed set of 50").

Deterministic (seeded), so every run and both servers of a side-by-side comparison see the same 50;
varied the way real response_format schemas are: flat and nested objects, bounded strings,
integer / number bounds, enums, arrays with minItems / maxItems, nullable fields, patterns and
formats. Every schema is closed (additionalProperties false) as OpenAI's strict mode requires.
"""
from __future__ import annotations

import random

_WORDS = ["title", "author", "year", "rating", "tags", "summary", "price", "city", "country", "email",
          "score", "level", "status", "items", "count", "name", "id", "date", "active", "notes",
          "kind", "owner", "color", "size", "weight", "label", "code", "url", "phone", "priority"]


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


def response_format(schema: dict, index: int) -> dict:
    """OpenAI's response_format for a schema (strict json_schema), as a benchmark client sends it."""
    return {"type": "json_schema", "json_schema": {"name": f"bench_{index}", "schema": schema, "strict": True}}
