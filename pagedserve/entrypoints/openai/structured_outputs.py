"""Request fields -> StructuredOutputsParams, checked here so that a bad constraint is a 400.

Sources, at most one per request: OpenAI's response_format, vLLM's structured_outputs, the
older guided_* fields, and a tool_choice that forces a call (tools.py). A JSON schema must be
valid JSON Schema (jsonschema's meta-schema check) and every constraint must convert to a
grammar (xgrammar's tokenizer-free conversion, milliseconds); the engine then compiles it
against the tokenizer. Each failure names the field and the problem.
"""
from __future__ import annotations

import json
from typing import Any

from pagedserve.entrypoints.openai.protocol import StructuredOutputFields
from pagedserve.entrypoints.openai.serving_common import APIError
from pagedserve.sampling_params import StructuredOutputsParams

GRAMMAR_BACKENDS = ("auto", "xgrammar")
_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")


def _sources(req: StructuredOutputFields) -> list[tuple[str, dict[str, Any]]]:
    """(param, StructuredOutputsParams keyword arguments) of each field that asks for one."""
    out: list[tuple[str, dict[str, Any]]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            out.append(("response_format", {"json_object": True}))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise APIError("response_format of type json_schema needs json_schema.schema",
                               param="response_format.json_schema")
            out.append(("response_format.json_schema.schema", {"json": rf.json_schema.json_schema}))
        else:  # structural_tag: xgrammar's format, passed on whole
            tag = rf.model_dump(exclude_none=True)
            out.append(("response_format", {"structural_tag": tag}))
    so = req.structured_outputs
    if so is not None:
        kinds = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                   ("grammar", so.grammar), ("json_object", so.json_object or None),
                                   ("structural_tag", so.structural_tag)) if v is not None}
        if len(kinds) != 1:
            raise APIError("structured_outputs must set exactly one of json, regex, choice, "
                           f"grammar, json_object, structural_tag; got {sorted(kinds) or 'none'}",
                           param="structured_outputs")
        (kind, value), = kinds.items()
        kw = {kind: value, **{o: getattr(so, o) for o in _OPTIONS}}
        out.append((f"structured_outputs.{kind}", kw))
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                        ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, field)
        if value is not None:
            out.append((field, {kind: value}))
    return out


async def resolve_structured_outputs(engine: Any, req: StructuredOutputFields,
                                     constraint: tuple[str, dict] | None = None
                                     ) -> StructuredOutputsParams | None:
    """The request's checked output constraint, or None; the grammar check runs on the
    engine's tokenizer thread, off the event loop."""
    found = structured_outputs_of(req, constraint)
    if found is None:
        return None
    params, param = found
    await engine.run(check_compiles, params, param)
    return params


def structured_outputs_of(req: StructuredOutputFields, constraint: tuple[str, dict] | None = None
                          ) -> tuple[StructuredOutputsParams, str] | None:
    """The request's one output constraint and the field it came from (constraint: (param,
    StructuredOutputsParams keyword arguments) that the tools need, tools.ToolPlan)."""
    backend = req.guided_decoding_backend
    if backend is not None and backend not in GRAMMAR_BACKENDS:
        raise APIError(f"guided_decoding_backend must be one of {', '.join(GRAMMAR_BACKENDS)}, "
                       f"got {backend!r}", param="guided_decoding_backend")
    sources = _sources(req)
    if constraint is not None:
        sources.append(constraint)
    if not sources:
        if req.guided_whitespace_pattern is not None:
            raise APIError("guided_whitespace_pattern needs a JSON constraint (guided_json, "
                           "response_format, ...)", param="guided_whitespace_pattern")
        return None
    if len(sources) > 1:
        names = " and ".join(p.split(".")[0] for p, _ in sources[:2])
        raise APIError(f"{names} both constrain the output; send one of them",
                       param=sources[1][0].split(".")[0])
    param, kw = sources[0]
    if req.guided_whitespace_pattern is not None:
        kw["whitespace_pattern"] = req.guided_whitespace_pattern
    if "json" in kw:
        kw["json"] = check_json_schema(kw["json"], param)
    try:
        return StructuredOutputsParams(**kw), param
    except ValueError as e:
        raise APIError(str(e), param=param) from None


def check_json_schema(schema: Any, param: str) -> dict:
    """The schema as a dict; 400 unless it is a JSON object that is valid JSON Schema."""
    import jsonschema

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise APIError(f"{param} is not JSON: {e}", param=param) from None
    if not isinstance(schema, dict):
        raise APIError(f"{param} must be a JSON Schema object, got {type(schema).__name__}",
                       param=param)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = e.json_path if e.json_path != "$" else "the top level"
        raise APIError(f"{param} is not a valid JSON Schema: {e.message} (at {where})",
                       param=param) from None
    return schema


def check_compiles(params: StructuredOutputsParams, param: str) -> None:
    """400 when the grammar library cannot turn the constraint into a grammar. Runs off the
    event loop (AsyncLLMEngine.run): a large schema takes milliseconds."""
    try:
        import xgrammar as xgr
    except ImportError:  # the engine reports it when it compiles
        return
    kind = params.kind
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(
                json.dumps(params.json), any_whitespace=not params.disable_any_whitespace,
                strict_mode=True)
        elif kind == "regex":
            xgr.Grammar.from_regex(params.regex)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(params.grammar)
        elif kind == "structural_tag":
            tag = params.structural_tag
            if isinstance(tag, dict) and "structures" in tag:  # vLLM's older shape
                items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                               end=s["end"]) for s in tag["structures"]]
                xgr.Grammar.from_structural_tag(items, tag.get("triggers", []))
            else:
                xgr.Grammar.from_structural_tag(tag if isinstance(tag, str) else json.dumps(tag))
    except Exception as e:  # xgrammar raises RuntimeError / ValueError with its parser's message
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise APIError(f"{param} cannot be compiled to a grammar: {_strip_location(msg)}",
                       param=param) from None


def _strip_location(msg: str) -> str:
    """xgrammar prefixes '[time] /project/cpp/file.cc:94: '; the client needs the rest."""
    if msg.startswith("[") and ".cc:" in msg:
        return msg.split(": ", 1)[-1]
    return msg
