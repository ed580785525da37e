"""The structured-output benchmark's schemas: valid JSON Schema, compiled by xgrammar, and unable
to close before any workload's max_tokens (the property that makes constrained and unconstrained
runs produce the same token counts)."""
import json

import jsonschema
import pytest

from pagedserve.benchmark.json_schemas import MIN_ITEMS, benchmark_schemas, schema_per_request, serving_schemas
from pagedserve.demo_model import DEMO_MODEL_DIR
from pagedserve.workloads import make_workload


@pytest.mark.parametrize("make", [benchmark_schemas, serving_schemas])
def test_fifty_distinct_valid_schemas(make):
    schemas = make(50)
    assert len({json.dumps(s, sort_keys=True) for s in schemas}) == 50
    for s in schemas:
        jsonschema.Draft202012Validator.check_schema(s)
    assert make(50) == schemas  # a fixed set


def test_no_schema_closes_before_max_tokens():
    longest = max(r.output_len for r in make_workload("sharegpt-like", 1000, float("inf"), seed=0,
                                                      vocab_size=32000, max_total_len=4096))
    # An item is at least two characters (value and comma): outputs the length of any workload's
    # could close only with tokens that each span several items, which noise logits rarely pick
    # (the benchmark's records compare each request's output length with its max_tokens).
    assert MIN_ITEMS > longest
    # A serving schema refuses an instance whose tail is one item short, and accepts it at MIN_ITEMS.
    schema = serving_schemas(1)[0]
    tail_item = {"type": "string", "enum": ["red", "green", "blue", "cyan", "magenta"]}
    assert schema["properties"]["zz_tail"]["items"] == tail_item
    assert serving_schemas(1)[0]["required"][-1] == "zz_tail"
    validator = jsonschema.Draft202012Validator(schema)
    assert any(e.validator == "minItems" for e in
               validator.iter_errors({"zz_tail": ["red"] * (MIN_ITEMS - 1)}))
    assert not any(e.validator == "minItems" for e in
                   validator.iter_errors({"zz_tail": ["red"] * MIN_ITEMS}))


def test_requests_draw_from_the_set_reproducibly():
    a, b = schema_per_request(300), schema_per_request(300)
    assert a == b
    assert len({json.dumps(s, sort_keys=True) for s in a}) > 40


def test_every_schema_compiles_with_xgrammar():
    xgr = pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok))
    for s in serving_schemas(50) + benchmark_schemas(50):
        compiler.compile_json_schema(json.dumps(s))
