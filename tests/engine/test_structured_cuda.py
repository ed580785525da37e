"""Structured outputs on CUDA (skipped without a GPU): the bitmask is uploaded and applied to the
logits on the device (xgrammar's Triton kernel) before sampling, in the model's dtype; the fused
Triton sampling path (unseeded temperature rows), the torch path (seeded rows), CUDA-graph decode
and overlapped steps all honour it."""
import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from pagedserve import SamplingParams
from pagedserve.demo_model import DEMO_MODEL_DIR
from pagedserve.engine.structured import StructuredOutputs
from pagedserve.sampling_params import StructuredOutputsParams as SO

from .helpers import assert_no_leak, make_llm, tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_device_mask_equals_the_host_reference(dtype):
    """Rows 1 and 3 constrained, rows 0 and 2 untouched: on the device exactly the tokens the
    matcher forbids become -inf, everything else keeps its value."""
    tok = tokenizer(str(DEMO_MODEL_DIR))
    vocab = 2048
    so = StructuredOutputs(tok, vocab, {1}, torch.device("cuda"))
    grammar = so.check(SO(regex="[0-9]{2}-[a-z]+"))
    compiled = so.pool.submit(("regex", "t"), grammar).result()
    g1 = so.seqs.start(101, compiled)
    g3 = so.seqs.start(103, compiled)
    g3.catch_up(tok.encode("42-", add_special_tokens=False))  # inside [a-z]+: g1 still wants digits
    logits = torch.randn(4, vocab, device="cuda", dtype=dtype)
    before = logits.clone()
    filled = so.fill([(1, g1), (3, g3)])
    so.apply(logits, filled)
    host = xgr.allocate_token_bitmask(4, vocab)
    g1.matcher.fill_next_token_bitmask(host, 1)
    g3.matcher.fill_next_token_bitmask(host, 3)
    bits = (host[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.reshape(4, -1)[:, :vocab].bool().cuda()
    for row in (1, 3):
        assert torch.equal(logits[row][allowed[row]], before[row][allowed[row]])
        assert torch.isinf(logits[row][~allowed[row]]).all() and (logits[row][~allowed[row]] < 0).all()
        assert 0 < allowed[row].sum() < vocab
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert not torch.equal(allowed[1], allowed[3])


def test_device_upload_full_and_mixed_batches_over_steps():
    """Steps alternate a batch where every row is masked (no indices: the persistent device
    bitmask alone) and one where only some are (the pinned indices go up too), while the host
    buffers take turns: each step masks exactly what a torch masked_fill of the matchers' own
    rows does, and leaves the other rows alone."""
    tok = tokenizer(str(DEMO_MODEL_DIR))
    vocab = 2048
    so = StructuredOutputs(tok, vocab, {1}, torch.device("cuda"), fill_threads=2)
    compiled = so.pool.submit(("regex", "u"), so.check(SO(regex="[0-9]{2}-[a-z]+"))).result()
    gs = [so.seqs.start(200 + i, compiled) for i in range(24)]
    texts = ["", "4", "42", "42-", "42-ab"]
    for i, g in enumerate(gs):
        g.catch_up(tok.encode(texts[i % 5], add_special_tokens=False))
    bits = torch.arange(32, dtype=torch.int32)
    for step in range(6):
        rows = list(range(24)) if step % 2 == 0 else list(range(1, 24, 3))
        logits = torch.randn(24, vocab, device="cuda", dtype=torch.bfloat16)
        before = logits.clone()
        mask = so.fill([(i, gs[i]) for i in rows])
        so.apply(logits, mask)
        for i in range(24):
            if i not in rows:
                assert torch.equal(logits[i], before[i])
                continue
            one = xgr.allocate_token_bitmask(1, vocab)
            gs[i].matcher.fill_next_token_bitmask(one, 0)
            allowed = ((one[0, :, None] >> bits) & 1).reshape(-1)[:vocab].bool().cuda()
            assert torch.equal(logits[i], before[i].masked_fill(~allowed, float("-inf")))
        # Rotate which grammar sits in which row so that every step's rows differ.
        gs = gs[5:] + gs[:5]
    so.shutdown()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_cuda_engine_outputs_follow_their_grammars(async_scheduling):
    schema = {"type": "object", "required": ["name", "n"], "additionalProperties": False,
              "properties": {"name": {"type": "string", "maxLength": 6},
                             "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    regex = r"[A-Z][a-z]{2,5} [0-9]{1,3}"
    llm = make_llm(DEMO_MODEL_DIR, device="cuda", dtype="bfloat16", async_scheduling=async_scheduling,
                   max_num_seqs=32)
    assert llm.llm_engine.runner.graphs is not None
    params = []
    for i in range(8):
        params += [
            # unseeded temperature rows: the fused Triton sampling kernel reads the masked logits
            SamplingParams(temperature=1.0, max_tokens=64,
                           structured_outputs=SO(json=schema, disable_any_whitespace=True)),
            # seeded top-p rows: the torch path
            SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=24, structured_outputs=SO(regex=regex)),
            SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=SO(choice=["alpha", "omega"])),
            SamplingParams(temperature=1.0, max_tokens=24),  # unconstrained neighbour
        ]
    outs = llm.generate(["In the beginning"] * len(params), params, use_tqdm=False)
    stopped = 0
    for i, o in enumerate(outs):
        c = o.outputs[0]
        if i % 4 == 3 or c.finish_reason != "stop":
            continue
        stopped += 1
        if i % 4 == 0:
            jsonschema.validate(json.loads(c.text), schema)
        elif i % 4 == 1:
            assert re.fullmatch(regex, c.text), c.text
        else:
            assert c.text in ("alpha", "omega")
    assert stopped >= 0.8 * 24
    assert_no_leak(llm)
    llm.shutdown()
