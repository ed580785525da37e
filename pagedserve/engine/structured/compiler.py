"""Grammars from StructuredOutputsParams, compiled off the step loop and cached (xgrammar).

Two halves, as vLLM splits them:
  - parse_spec (microseconds for ordinary specs, milliseconds for large JSON schemas): the spec
    becomes an xgrammar Grammar (JSON Schema / regex / EBNF -> its EBNF form). This is where a
    bad schema, regex or grammar is found, so add_request can refuse it with a ValueError naming
    the problem (the server answers 400); also a schema keyword xgrammar would ignore
    (unenforced_keyword).
    (A grammar that matches no text, "root ::= root", is found when its mask first allows no
    token: token_application's _grammar_ended gives the request an error then.)
  - GrammarCompilerPool.submit (asynchronous): the tokenizer-dependent compile (the per-state
    token-mask cache, milliseconds to seconds) on a thread pool, cached by the spec's key. A
    compile in progress is shared by every request that asks for the same spec; a finished one is
    a cache hit. The cache belongs to one tokenizer (one engine has one), so (spec, tokenizer) is
    the key in effect.
The engine core behind the API server hands submit the parse itself, to run on the compile
thread before the compile: the server has parsed the spec already (to answer 400), and for a
large JSON schema the conversion takes milliseconds (~6.5 ms at 33 KB), which on the step
thread would stall every request in flight (xgrammar gives up the GIL while it converts).
Elsewhere the parse stays synchronous, so that add_request's ValueError names a bad spec.
The pool counts compiles, cache hits and compile seconds for /metrics (CompileStats).
"""
from __future__ import annotations

import bisect
import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import xgrammar as xgr

from pagedserve.metrics import COMPILE_BUCKETS
from pagedserve.sampling_params import StructuredOutputsParams, check_json_depth

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "xgrammar")


def _ebnf_literal(text: str) -> str:
    """text as an xgrammar EBNF string literal (backslash, quote and control characters escaped)."""
    out = []
    for ch in text:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly the given strings."""
    if any(not c for c in choices):
        raise ValueError("structured_outputs.choice must not contain empty strings")
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def parse_spec(spec: StructuredOutputsParams, max_whitespace: int = 0, schema_checked: bool = False,
               keywords_checked: bool = False) -> xgr.Grammar:
    """The spec as an xgrammar Grammar; ValueError naming the field and xgrammar's reason.
    max_whitespace (> 0): the most whitespace characters a JSON grammar allows in one gap between
    JSON tokens (EngineConfig.structured_outputs_max_whitespace). Unbounded, a model that keeps
    choosing newlines inside a JSON object runs to max_tokens and returns truncated JSON (the
    failure vLLM users report with xgrammar); bounded, it must write the next token once the gap
    is full. schema_checked: the JSON schema has passed jsonschema's meta-schema check already
    (the API server's check_json_schema), which costs ~7 ms per KB of schema: not twice.
    keywords_checked: unenforced_keyword has passed it already (the API server's check_compiles
    ran this function; ~0.1 ms per KB)."""
    kind = spec.kind
    if spec.whitespace_pattern is not None:
        raise ValueError("structured_outputs.whitespace_pattern is not supported by the xgrammar backend "
                         "(use disable_any_whitespace for compact JSON)")
    any_ws = not spec.disable_any_whitespace
    ws_cap = max_whitespace if any_ws and max_whitespace > 0 else None
    try:
        if kind == "json":
            schema = spec.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except (json.JSONDecodeError, RecursionError) as e:  # (json's decoder recurses)
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON Schema object, got {type(schema).__name__}")
            if not schema_checked:
                _check_schema(schema)
            loose = None if keywords_checked else unenforced_keyword(schema)
            if loose is not None:
                raise ValueError(f"structured_outputs.json {loose}")
            return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=any_ws, strict_mode=True,
                                                max_whitespace_cnt=ws_cap)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=any_ws, strict_mode=False,
                                                max_whitespace_cnt=ws_cap)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_grammar(spec.choice))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.grammar)
        if kind == "structural_tag":
            tag = spec.structural_tag
            return xgr.Grammar.from_structural_tag(tag if isinstance(tag, str) else json.dumps(tag))
    except ValueError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError (and its own errors) with a parser message
        raise ValueError(f"structured_outputs.{kind} cannot be compiled: {_short(e)}") from None
    raise ValueError(f"structured_outputs kind {kind!r} is not supported")


def _check_schema(schema: Any) -> None:
    """A schema that is not valid JSON Schema (draft 2020-12 meta-schema) is refused by name."""
    import jsonschema
    check_json_depth(schema)
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "/".join(str(p) for p in e.path) or "(root)"
        raise ValueError(f"structured_outputs.json is not a valid JSON Schema at {path}: {e.message}") from None


# JSON Schema keywords that xgrammar (0.2.9) accepts but does not enforce: its grammar is looser
# than the schema, and the output may break it while the response looks like an honoured request.
# vLLM falls back to another grammar backend for some of these; pagedserve has only xgrammar, so
# parse_spec refuses them by name (tests/engine/test_structured_outputs.py checks each one is
# still loose, so that a newer xgrammar that enforces one shows up there).
UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "contains", "minContains", "maxContains",
                       "dependentRequired", "dependentSchemas", "dependencies", "$dynamicRef")
# Next to one of these xgrammar reads that keyword alone: {"type": "integer", "anyOf": [...]}
# drops the type. Annotations beside them (title, description, default, $defs...) are fine.
_COMBINATORS = ("$ref", "allOf", "anyOf", "oneOf")
_ASSERTIONS = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "format", "maxItems", "minItems", "uniqueItems", "prefixItems",
    "items", "additionalItems", "unevaluatedItems", "maxProperties", "minProperties", "required",
    "properties", "patternProperties", "additionalProperties", "propertyNames", "unevaluatedProperties",
    *_COMBINATORS, *UNENFORCED_KEYWORDS})


def unenforced_keyword(schema: Any) -> str | None:
    """Why the grammar of this JSON schema would not enforce all of it ("uses `not` at
    $.properties.a, ..."), or None. Walks the subschemas where the schema's draft puts them
    (the referencing library's knowledge), so a property merely named "not" is no match."""
    from referencing.jsonschema import DRAFT202012, specification_with

    if not isinstance(schema, dict):
        return None
    spec = specification_with(schema.get("$schema", ""), default=DRAFT202012)
    todo = [(schema, "$")]
    while todo:
        node, path = todo.pop()
        why = _loose_here(node)
        if why is not None:
            return f"uses {why} at {path}, which the grammar backend (xgrammar) does not enforce: " \
                   "the output could break the schema; leave it out, or express it with other keywords"
        subs = [s for s in spec.subresources_of(node) if isinstance(s, dict)]
        todo.extend((v, where) for where, v in _places(node, path) if any(v is s for s in subs))
    return None


def _places(node: dict, path: str):
    """(path, value) of every value one or two levels under node: where its subschemas sit
    ("not": {...}, "anyOf": [{...}], "properties": {"a": {...}})."""
    for key, value in node.items():
        here = f"{path}.{key}"
        yield here, value
        if isinstance(value, list):
            yield from ((f"{here}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, dict):
            yield from ((f"{here}.{k}", v) for k, v in value.items())


def _loose_here(node: dict) -> str | None:
    """The first keyword of this one schema object xgrammar would not enforce, as `keyword`."""
    for kw in UNENFORCED_KEYWORDS:
        if kw in node:
            return f"`{kw}`"
    if node.get("uniqueItems") is True:
        return "`uniqueItems`"
    types = node.get("type")
    types = types if isinstance(types, list) else [types]
    if "multipleOf" in node and not ("integer" in types and "number" not in types):
        return "`multipleOf` (enforced for type integer only)"
    ref = node.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        return f"`$ref` {ref[:100]!r} (only references inside the schema, '#/...', are followed)"
    allof = node.get("allOf")
    if isinstance(allof, list) and len(allof) > 1:
        return "`allOf` with more than one subschema"
    combinator = next((kw for kw in _COMBINATORS if kw in node), None)
    if combinator is not None:
        beside = sorted(k for k in node if k in _ASSERTIONS and k != combinator)
        if beside:
            return f"`{beside[0]}` beside `{combinator}` (which xgrammar reads alone)"
    return None


def _short(e: BaseException) -> str:
    """xgrammar's messages start with a C++ source location: keep the reason."""
    text = str(e).strip()
    for marker in ("Check failed: (error.empty()) is false: ", ".cc:"):
        if marker in text:
            text = text.split(marker, 1)[1]
            text = text.split(": ", 1)[1] if marker == ".cc:" and ": " in text else text
    return text.splitlines()[0][:500] if text else type(e).__name__


@dataclass
class CompileStats:
    """Counters since start (the metrics are cumulative)."""
    compiles: int = 0                 # grammars compiled (cache misses that ran)
    cache_hits: int = 0               # requests served by a cached or in-progress compile
    failures: int = 0                 # compiles that raised (behind the server: or their parse)
    seconds_sum: float = 0.0
    bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(COMPILE_BUCKETS) + 1))

    def observe(self, seconds: float) -> None:
        self.seconds_sum += seconds
        self.bucket_counts[bisect.bisect_left(COMPILE_BUCKETS, seconds)] += 1


class GrammarCompilerPool:
    """xgrammar's compiler for one tokenizer, on `threads` worker threads, with a spec-keyed cache.

    Thread-safety: submit() is called from the engine thread only; the worker threads only run
    the compile (and, behind the server, the parse before it) and record its stats under the lock.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], threads: int = 2,
                 cache_size: int = 1024, cache_limit_bytes: int = 512 << 20) -> None:
        """cache_size / cache_limit_bytes bound the cache by entries and by the compiled grammars'
        memory (xgrammar's memory_size_bytes; a grammar's token-mask cache grows with the
        vocabulary), 512 MiB as vLLM's VLLM_XGRAMMAR_CACHE_MB; the oldest finished entries go first."""
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=list(stop_token_ids))
        self.vocab_size = vocab_size
        # xgrammar parallelises inside one compile too; our pool runs several compiles at once.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max(1, threads))
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="grammar-compile")
        self._cache: dict[tuple[str, str], Future] = {}   # insertion order = age, for eviction
        self._cache_size = cache_size
        self._cache_limit_bytes = cache_limit_bytes
        self._bytes: dict[tuple[str, str], int] = {}   # finished entries' sizes
        self._lock = threading.Lock()
        self.stats = CompileStats()

    def has(self, key: tuple[str, str]) -> bool:
        """Whether submit(key, ...) would be a cache hit (compiled, or compiling, without failure)."""
        fut = self._cache.get(key)
        return fut is not None and not (fut.done() and fut.exception() is not None)

    def submit(self, key: tuple[str, str], grammar: xgr.Grammar | Callable[[], xgr.Grammar]) -> Future:
        """A future of the CompiledGrammar for `key`. grammar: parse_spec's result for it, or a
        callable that returns it, run on the compile thread before the compile (the engine behind
        the server: the parse off the step thread); what that callable raises (a ValueError for a
        bad spec) is the future's exception, as a failed compile's is, and is not cached."""
        fut = self._cache.get(key)
        if self.has(key):
            with self._lock:
                self.stats.cache_hits += 1
            self._cache[key] = self._cache.pop(key)  # most recently used last
            return fut
        fut = self._pool.submit(self._compile, grammar)
        self._cache[key] = fut
        self._evict()
        return fut

    def _evict(self) -> None:
        """Drop the oldest finished entries while the cache is over either bound (an entry still
        compiling stays: requests wait on it)."""
        for k, f in self._cache.items():
            if k not in self._bytes and f.done():
                self._bytes[k] = 0 if f.exception() is not None else f.result().memory_size_bytes
        total = sum(self._bytes.values())
        for k in list(self._cache):
            if len(self._cache) <= self._cache_size and total <= self._cache_limit_bytes:
                break
            if k in self._bytes:
                total -= self._bytes.pop(k)
                del self._cache[k]

    def _compile(self, grammar: xgr.Grammar | Callable[[], xgr.Grammar]) -> xgr.CompiledGrammar:
        t0 = time.perf_counter()  # a parse run here counts in the compile seconds: it is this thread's work
        try:
            if not isinstance(grammar, xgr.Grammar):
                grammar = grammar()
            compiled = self._compiler.compile_grammar(grammar)
        except Exception:
            with self._lock:
                self.stats.failures += 1
            raise
        dt = time.perf_counter() - t0
        with self._lock:
            self.stats.compiles += 1
            self.stats.observe(dt)
        return compiled

    def shutdown(self) -> None:
        """Stop taking compiles; one still running finishes in its thread (xgrammar cannot cancel)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
