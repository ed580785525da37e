"""The structured-output benchmark's schemas: valid JSON Schema, compiled by xgrammar, and unable
to close before any workload's max_tokens (the property that makes constrained and unconstrained
runs produce the same token counts)."""
import json

import jsonschema
import pytest

from pagedserve.benchmark.json_schemas import MIN_ITEMS, bench_schemas, schema_per_request
from pagedserve.demo_model import DEMO_MODEL_DIR
from pagedserve.workloads import make_workload


def test_fifty_distinct_valid_schemas():
    schemas = bench_schemas(50)
    assert len({json.dumps(s, sort_keys=True) for s in schemas}) == 50
    for s in schemas:
        jsonschema.Draft202012Validator.check_schema(s)
    assert bench_schemas(50) == schemas  # a fixed set


def test_no_schema_closes_before_max_tokens():
    longest = max(r.output_len for r in make_workload("sharegpt-like", 1000, float("inf"), seed=0,
                                                      vocab_size=32000, max_total_len=4096))
    # An item is at least two characters (value and comma): outputs the length of any workload's
    # could close only with tokens that each span several items, which noise logits rarely pick
    # (the benchmark's records compare each request's output length with its max_tokens).
    assert MIN_ITEMS > longest
    small = dict(bench_schemas(1)[0])
    instance = {k: None for k in small["properties"]}
    instance["items"] = []
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(instance, small)


def test_requests_draw_from_the_set_reproducibly():
    a, b = schema_per_request(300), schema_per_request(300)
    assert a == b
    assert len({json.dumps(s, sort_keys=True) for s in a}) > 40


def test_every_schema_compiles_with_xgrammar():
    xgr = pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok))
    for s in bench_schemas(50):
        compiler.compile_json_schema(json.dumps(s))
