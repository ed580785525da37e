"""The per-step mask path (engine/structured/masks.py, matchers.SeqGrammars.advance) against plain
references, on the CPU (tests/engine/test_structured_cuda.py runs the device upload):

- a batch where only some logits rows are constrained (and one constrained grammar is done)
  masks exactly the live constrained rows, as a torch masked_fill with each matcher's own
  fill_next_token_bitmask does; the other rows keep every value;
- a batch where every row is constrained (xgrammar called without indices) likewise;
- the threaded fill writes the same rows as one matcher at a time;
- advance_and_fill (a batched accept, then the fill, on threads) leaves every matcher where
  per-row catch_up leaves a fork of it, and fills the row the fork fills, including rows several
  tokens behind, a pending token and a stop token (that row is left unmasked).
"""
import pytest
import torch
import xgrammar as xgr

from pagedserve.demo_model import DEMO_MODEL_DIR
from pagedserve.engine.structured import StructuredOutputs
from pagedserve.engine.structured.matchers import SeqGrammars
from pagedserve.sampling_params import StructuredOutputsParams as SO

from .helpers import tokenizer

VOCAB = 2048
SPECS = [SO(regex="[0-9]{2}-[a-z]+"), SO(choice=["alpha", "omega", "beta"]),
         SO(json={"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}},
            disable_any_whitespace=True)]


@pytest.fixture(scope="module")
def setup():
    tok = tokenizer(str(DEMO_MODEL_DIR))
    so = StructuredOutputs(tok, VOCAB, {tok.eos_token_id}, torch.device("cpu"), fill_threads=3)
    compiled = [so.pool.submit(spec.key(), so.check(spec)).result() for spec in SPECS]
    yield tok, so, compiled
    so.shutdown()


def _enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _reference_allowed(grammars, rows):
    """{row: bool[VOCAB]} from each matcher's own single-row fill."""
    out = {}
    for i, g in zip(rows, grammars):
        one = xgr.allocate_token_bitmask(1, VOCAB)
        g.matcher.fill_next_token_bitmask(one, 0)
        bits = (one[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        out[i] = bits.reshape(-1)[:VOCAB].bool()
    return out


def _check_masked(logits, before, allowed, untouched):
    for i, a in allowed.items():
        assert 0 < a.sum() < VOCAB
        expect = before[i].masked_fill(~a, float("-inf"))
        assert torch.equal(logits[i], expect), i
    for i in untouched:
        assert torch.equal(logits[i], before[i]), i


def test_mixed_batch_masks_exactly_the_live_constrained_rows(setup):
    tok, so, compiled = setup
    grammars = {}
    texts = {1: (0, "4"), 2: (1, ""), 4: (1, "al"), 5: (2, '{"n":'), 7: (2, ""), 9: (0, "7")}
    for row, (k, text) in texts.items():
        g = grammars[row] = so.seqs.start(1000 + row, compiled[k])
        g.catch_up(_enc(tok, text))
        assert not g.rejected
    done = so.seqs.start(1099, compiled[1])
    done.catch_up(_enc(tok, "beta") + [tok.eos_token_id])
    assert done.done and not done.rejected
    rows = sorted([(r, g) for r, g in grammars.items()] + [(6, done)], key=lambda r: r[0])
    logits = torch.randn(11, VOCAB)
    before = logits.clone()
    mask = so.fill(rows)
    assert mask.indices == sorted(grammars)  # the done row is left alone
    so.apply(logits, mask)
    _check_masked(logits, before, _reference_allowed(list(grammars.values()), list(grammars)),
                  untouched=[0, 3, 6, 8, 10])


def test_full_batch_is_masked_without_indices(setup):
    tok, so, compiled = setup
    gs = [so.seqs.start(2000 + i, compiled[i % len(compiled)]) for i in range(20)]
    for i, g in enumerate(gs):
        g.catch_up(_enc(tok, ["1", "om", '{"n":'][i % 3] if i % 2 else ""))
        assert not g.rejected
    logits = torch.randn(20, VOCAB, dtype=torch.bfloat16)
    before = logits.clone()
    mask = so.fill(list(enumerate(gs)))
    assert mask.indices == list(range(20)) and mask.rows == 20
    so.apply(logits, mask)
    _check_masked(logits, before, _reference_allowed(gs, range(20)), untouched=[])


def test_threaded_fill_matches_a_row_at_a_time(setup):
    tok, so, compiled = setup
    assert so._fill_threaded is not so._fill_serial  # 3 xgrammar threads from 8 rows
    gs = [so.seqs.start(3000 + i, compiled[i % len(compiled)]) for i in range(40)]
    for i, g in enumerate(gs):
        g.catch_up(_enc(tok, ["12-a", "a", '{"n":-'][i % 3][: i % 5]))
        assert not g.rejected
    rows = [(2 * i + 1, g) for i, g in enumerate(gs)]  # odd rows only, up to 79
    mask = so.fill(rows)
    ref = torch.zeros(80, mask.bitmask.shape[1], dtype=torch.int32)
    for i, g in rows:
        g.matcher.fill_next_token_bitmask(ref, i)
    assert torch.equal(mask.bitmask[1:80:2], ref[1::2])


def test_advance_and_fill_equals_catch_up_and_fill_row_by_row(setup):
    """30 rows on 3 threads: far behind, one behind, a pending token, caught up; some close."""
    tok, so, compiled = setup
    text = {0: "12-ab", 1: "omega", 2: '{"n": 42}'}
    rows, refs = [], []
    for k in range(30):
        kind = k % 3
        toks = _enc(tok, text[kind]) + ([tok.eos_token_id] if kind == 1 else [])
        g = so.seqs.start(4000 + k, compiled[kind])
        seen = k % 4  # 0: far behind, 1-2: one behind or a pending token, 3: caught up
        upto = {0: 0, 1: len(toks) - 1, 2: len(toks) - 1, 3: len(toks)}[seen]
        g.catch_up(toks[:upto])
        pending = toks[-1] if seen == 2 else None
        out = toks[:-1] if seen == 2 else toks
        rows.append((2 * k, g, out, pending))
        refs.append(g.fork())
    mask = so.advance_and_fill(rows)
    live = []
    for (i, g, out, pending), ref in zip(rows, refs):
        ref.catch_up(out, pending)
        assert (g.num_accepted, g.rejected, g.done) == (ref.num_accepted, ref.rejected, ref.done)
        assert g.done == g.matcher.is_terminated()
        if not g.done:
            live.append(i)
            one = xgr.allocate_token_bitmask(1, VOCAB)
            ref.matcher.fill_next_token_bitmask(one, 0)
            assert torch.equal(mask.bitmask[i], one[0]), i
    assert mask.indices == live and mask.rows == live[-1] + 1
    assert 0 < len(live) < len(rows) and not any(g.rejected for _, g, _, _ in rows)
    # A token the grammar refuses: rejected and done, as catch_up does.
    g = so.seqs.start(4999, compiled[0])
    SeqGrammars.advance([(g, _enc(tok, "x"), None), (so.seqs.start(4998, compiled[0]), _enc(tok, "1"), None)])
    assert g.rejected and g.done and g.num_accepted == 1
