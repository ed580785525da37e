"""Structured outputs with speculation: the grammar trims proposals and masks every verified
position, so greedy outputs equal those without speculation and still match their grammar;
seeded sampled outputs still satisfy the schema."""
import json

import jsonschema

from pagedserve import SamplingParams
from pagedserve.demo_model import DEMO_MODEL_DIR
from pagedserve.sampling_params import StructuredOutputsParams as SO
from engine.helpers import assert_no_leak, make_llm

SCHEMA = {"type": "object", "required": ["tags", "n"], "additionalProperties": False,
          "properties": {"tags": {"type": "array", "minItems": 3, "maxItems": 6,
                                  "items": {"type": "string", "enum": ["lamb", "lion", "dove"]}},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999}}}
# The prompt holds documents of the schema's shape: the n-gram proposer copies from them.
PROMPT = ('{"tags":["lamb","lion","dove","lamb"],"n":12}\n{"tags":["dove","lamb","lion"],"n":7}\n'
          '{"tags":["lamb","lion","dove","lamb"],"n":12}\n')
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def _params(**kw):
    return SamplingParams(max_tokens=60, structured_outputs=SO(json=SCHEMA, disable_any_whitespace=True), **kw)


def test_grammar_checks_proposals_and_masks_verification():
    base = make_llm(DEMO_MODEL_DIR, num_gpu_blocks_override=128)
    spec = make_llm(DEMO_MODEL_DIR, num_gpu_blocks_override=128, speculative_config=NGRAM)
    greedy = [_params(temperature=0.0)] * 2
    want = base.generate([PROMPT, "In the beginning"], greedy, use_tqdm=False)
    got = spec.generate([PROMPT, "In the beginning"], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for o in got:
        if o.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    stats = spec.get_spec_decode_stats()
    assert stats.num_accepted_tokens > 0, stats
    sampled = spec.generate([PROMPT] * 3, [_params(temperature=1.0, seed=s) for s in range(3)], use_tqdm=False)
    for o in sampled:
        c = o.outputs[0]
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert_no_leak(spec)
