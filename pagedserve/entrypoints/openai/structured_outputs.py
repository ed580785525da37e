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
from pagedserve.sampling_params import StructuredOutputsParams, check_json_depth

GRAMMAR_BACKENDS = ("auto", "xgrammar")
# Constraints already checked (a benchmark or an agent sends the same few again and again): the
# meta-schema check and the grammar conversion cost milliseconds each, on the tokenizer thread.
_CHECKED_MAX = 1024
_checked_schemas: dict[str, dict] = {}      # canonical JSON text -> the schema
_compiled_specs: set[tuple[str, str]] = set()  # StructuredOutputsParams.key()
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
            if rf.json_schema.description:
                # OpenAI shows it to the model as guidance; here the grammar alone shapes the
                # output, so it would be dropped: a 400, and the text belongs in a message.
                raise APIError("response_format.json_schema.description is not supported: the schema "
                               "is enforced by a grammar; put guidance for the model in a message",
                               param="response_format.json_schema.description")
            out.append(("response_format.json_schema.schema", {"json": rf.json_schema.json_schema}))
        else:  # structural_tag
            tag = _tag_format(rf.model_dump(exclude_none=True))
            out.append(("response_format", {"structural_tag": tag}))
    so = req.structured_outputs
    if so is not None:
        kinds = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                   ("grammar", so.grammar), ("json_object", so.json_object or None),
                                   ("structural_tag", so.structural_tag)) if v is not None}
        if len(kinds) > 1:
            raise APIError("structured_outputs must set exactly one of json, regex, choice, "
                           f"grammar, json_object, structural_tag; got {sorted(kinds)}",
                           param="structured_outputs")
        if kinds:  # without a kind it only carries options for another field's constraint
            (kind, value), = kinds.items()
            out.append((f"structured_outputs.{kind}", {kind: _tag_format(value) if
                                                       kind == "structural_tag" else value}))
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                        ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, field)
        if value is not None:
            out.append((field, {kind: value}))
    return out


async def resolve_structured_outputs(engine: Any, req: StructuredOutputFields,
                                     constraint: tuple[str, dict] | None = None
                                     ) -> tuple[StructuredOutputsParams, str] | None:
    """The request's checked output constraint and the field that set it (a grammar that fails
    at run time names it in its error), or None. The checks run on the engine's
    tokenizer thread, off the event loop: jsonschema's meta-schema check of a 47 KB schema takes
    ~300 ms, and on the loop it stalled every stream that long. A request that asks for no
    constraint (most) takes no hop: its field checks alone run here."""
    if constraint is None and not _sources(req):
        return structured_outputs_of(req)  # None, or a 400 for a field that needs a constraint

    def check() -> tuple[StructuredOutputsParams, str] | None:
        found = structured_outputs_of(req, constraint)
        if found is not None:
            check_compiles(*found)
        return found
    return await engine.run(check)


def _tag_format(tag: Any) -> Any:
    """vLLM's older structural tag ({"structures": [{begin, schema, end}], "triggers"}) in
    xgrammar's current format (triggered_tags); anything else as given."""
    if not isinstance(tag, dict) or "structures" not in tag:
        return tag
    try:
        tags = [{"type": "tag", "begin": s["begin"], "end": s["end"],
                 "content": {"type": "json_schema", "json_schema": s["schema"]}}
                for s in tag["structures"]]
    except (KeyError, TypeError):
        raise APIError("each structural tag structure needs begin, schema and end",
                       param="structural_tag") from None
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "tags": tags,
                                                 "triggers": tag.get("triggers") or []}}


def structured_outputs_of(req: StructuredOutputFields, constraint: tuple[str, dict] | None = None
                          ) -> tuple[StructuredOutputsParams, str] | None:
    """The request's one output constraint and the field it came from (constraint: (param,
    StructuredOutputsParams keyword arguments) that the tools need, tools.ToolPlan)."""
    for field, value in (("guided_whitespace_pattern", req.guided_whitespace_pattern),
                         ("structured_outputs.whitespace_pattern",
                          req.structured_outputs and req.structured_outputs.whitespace_pattern)):
        if value is not None:
            raise APIError(f"{field} is not supported by the xgrammar backend; "
                           "structured_outputs.disable_any_whitespace gives compact JSON",
                           param=field)
    backend = req.guided_decoding_backend
    if backend is not None and backend not in GRAMMAR_BACKENDS:
        raise APIError(f"guided_decoding_backend must be one of {', '.join(GRAMMAR_BACKENDS)}, "
                       f"got {backend!r}", param="guided_decoding_backend")
    sources = _sources(req)
    if constraint is not None:
        sources.append(constraint)
    if not sources:
        return None
    if len(sources) > 1:
        names = " and ".join(p.split(".")[0] for p, _ in sources[:2])
        raise APIError(f"{names} both constrain the output; send one of them",
                       param=sources[1][0].split(".")[0])
    param, kw = sources[0]
    kw = dict(kw)
    if req.structured_outputs is not None:  # its options apply whichever field set the kind
        kw.update({o: getattr(req.structured_outputs, o) for o in _OPTIONS})
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
        except (ValueError, RecursionError) as e:  # (json's decoder recurses: "[[[[...")
            raise APIError(f"{param} is not JSON: {e}", param=param) from None
    try:
        check_json_depth(schema, param)
    except ValueError as e:
        raise APIError(str(e), param=param) from None
    text = json.dumps(schema, sort_keys=True) if isinstance(schema, dict) else None
    if text is not None and text in _checked_schemas:
        return _checked_schemas[text]
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
    if len(_checked_schemas) >= _CHECKED_MAX:
        _checked_schemas.pop(next(iter(_checked_schemas)))
    _checked_schemas[text] = schema
    return schema


def check_enforceable(schema: dict, param: str) -> None:
    """400 for a JSON schema with keywords the grammar backend would not enforce
    (compiler.unenforced_keyword): for tool parameters that a grammar forces, which do not pass
    through check_compiles as a schema of their own."""
    try:
        from pagedserve.engine.structured.compiler import unenforced_keyword
    except ImportError:  # no xgrammar: the engine reports it
        return
    loose = unenforced_keyword(schema)
    if loose is not None:
        raise APIError(f"{param} {loose}", param=param)


def check_compiles(params: StructuredOutputsParams, param: str) -> None:
    """400 when the grammar library cannot turn the constraint into a grammar: the engine's own
    tokenizer-free check (engine/structured/compiler.parse_spec, milliseconds), run here on the
    tokenizer thread so that the error names the request field."""
    try:
        from pagedserve.engine.structured.compiler import parse_spec
    except ImportError:  # no xgrammar: the engine reports it
        return
    key = params.key()
    if key in _compiled_specs:
        return
    try:
        parse_spec(params, schema_checked=True)  # (check_json_schema has run on any schema here)
    except ValueError as e:  # its messages name structured_outputs.<kind>: name the request's field
        msg = str(e)
        prefix = f"structured_outputs.{params.kind}"
        msg = param + msg[len(prefix):] if msg.startswith(prefix) else f"{param}: {msg}"
        raise APIError(msg, param=param) from None
    if len(_compiled_specs) >= _CHECKED_MAX:
        _compiled_specs.clear()
    _compiled_specs.add(key)
