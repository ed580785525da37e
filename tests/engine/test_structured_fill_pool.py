"""engine/structured/fill_pool.py (PAGEDSERVE_GRAMMAR_FILL_POOL=1) against the serial fill.

On two tokenizers (the demo model's 2k BPE, and a ~13k byte-level BPE trained here on this
package's own sources), matchers of JSON / regex / choice grammars walked to varied states, some
closed (their stop token accepted), fill a bitmask whose every word starts as garbage; the pool
must leave it bit-identical to one serial BatchGrammarMatcher(1) call on the same rows: 1 row,
fewer rows than threads, scattered rows, many rows (one chunk a thread, and several). An error
in any chunk (a closed grammar, which xgrammar refuses to fill, in the caller's first chunk or in
all the others) reaches the caller after every chunk has ended, and the pool fills correctly
after it. close() joins every worker.
Through StructuredOutputs with the switch set, advance_and_fill (closed grammars among the rows:
left out) fills what the serial path fills, and shutdown leaves no worker behind.
"""
import random
import threading
from pathlib import Path

import pytest
import torch
import xgrammar as xgr

import pagedserve
from pagedserve.demo_model import DEMO_MODEL_DIR
from pagedserve.engine.structured import StructuredOutputs
from pagedserve.engine.structured.fill_pool import FillPool
from pagedserve.engine.structured.manager import fill_pool_enabled
from pagedserve.sampling_params import StructuredOutputsParams as SO

from tiny_models import train_tokenizer

from .helpers import tokenizer

SPECS = [SO(json={"type": "object", "required": ["name", "n", "tags"], "additionalProperties": False,
                  "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"},
                                 "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bc"]}}}}),
         SO(regex="[0-9]{2}-[a-z]+"), SO(choice=["alpha", "omega", "beta"])]


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("grammar-fill-")]


@pytest.fixture(scope="module", params=["demo", "bpe13k"])
def walked(request, tmp_path_factory):
    """(StructuredOutputs, 30-odd open matchers in varied states, a few closed ones: their stop
    token accepted, which xgrammar refuses to fill: the engine leaves their rows out)."""
    if request.param == "demo":
        tok = tokenizer(str(DEMO_MODEL_DIR))
    else:
        sources = sorted(Path(pagedserve.__file__).parent.rglob("*.py"))
        tok = train_tokenizer(tmp_path_factory.mktemp("bpe"), vocab_size=16384,
                              corpus=[p.read_text(encoding="utf-8") for p in sources])
    vocab = len(tok)
    so = StructuredOutputs(tok, vocab, {tok.eos_token_id}, torch.device("cpu"), fill_threads=1)
    compiled = [so.pool.submit(s.key(), so.check(s)).result() for s in SPECS]
    rng = random.Random(0)
    matchers = []
    one = xgr.allocate_token_bitmask(1, vocab)
    bits = torch.arange(32, dtype=torch.int32)
    for i in range(48):
        m = xgr.GrammarMatcher(compiled[i % len(SPECS)])
        for _ in range(i % 9):  # walk: tokens the grammar allows, drawn at random
            if m.is_terminated():
                break
            m.fill_next_token_bitmask(one, 0)
            allowed = ((one[0, :, None] >> bits) & 1).reshape(-1)[:vocab].nonzero().flatten().tolist()
            m.accept_token(rng.choice(allowed))
        matchers.append(m)
    for m in matchers[5::11]:  # close some: the walk to an accepted stop token
        while not m.is_terminated():
            m.fill_next_token_bitmask(one, 0)
            allowed = ((one[0, :, None] >> bits) & 1).reshape(-1)[:vocab].nonzero().flatten().tolist()
            m.accept_token(tok.eos_token_id if tok.eos_token_id in allowed else rng.choice(allowed))
    closed = [m for m in matchers if m.is_terminated()]
    assert len(closed) >= 3 and len(matchers) - len(closed) >= 30
    yield so, [m for m in matchers if not m.is_terminated()], closed
    so.shutdown()


def _serial(matchers, indices, rows, words):
    ref = torch.full((rows, words), 0x5A5A5A5A, dtype=torch.int32)
    xgr.BatchGrammarMatcher(1).batch_fill_next_token_bitmask(matchers, ref, indices)
    return ref


@pytest.mark.parametrize("threads,chunks_per_thread,picks", [
    (4, 4, [7]),                          # 1 row: the caller alone
    (4, 1, [3, 5, 11]),                   # fewer rows than threads
    (3, 1, list(range(0, 30, 3))),        # scattered rows, several per chunk
    (4, 4, list(range(30))),              # many rows, more chunks than threads
])
def test_pool_fill_is_bit_identical_to_the_serial_fill(walked, threads, chunks_per_thread, picks):
    so, matchers, _ = walked
    ms = [matchers[k] for k in picks]
    indices = [2 * k + 1 for k in picks]  # odd rows: the even ones must stay untouched
    rows = indices[-1] + 2
    ref = _serial(ms, indices, rows, so.masks.words)
    pool = FillPool(threads, chunks_per_thread)
    try:
        for _ in range(2):  # the second call reuses the threads the first started
            got = torch.full_like(ref, 0x5A5A5A5A)
            pool.fill(ms, got, indices)
            assert torch.equal(got, ref)
        assert len(_workers()) == (threads - 1 if len(picks) > 1 else 0)
    finally:
        pool.close()
    assert not _workers()


def test_an_error_in_any_chunk_reaches_the_caller_after_all_chunks_end(walked):
    so, matchers, closed = walked
    ms = matchers[:12]
    pool = FillPool(3, chunks_per_thread=2)  # 6 chunks: rows c, c + 6; the caller fills chunk 0 first
    try:
        # A closed grammar (xgrammar refuses to fill it) in the caller's first chunk, then in
        # every other chunk (taken by the workers, or by the caller once its own is done).
        for bad in ([0], [1, 2, 3, 4, 5]):
            with pytest.raises(RuntimeError, match="terminated"):
                pool.fill([closed[0] if r in bad else m for r, m in enumerate(ms)],
                          torch.zeros(12, so.masks.words, dtype=torch.int32), list(range(12)))
            assert pool._done.empty() and pool._work.empty()  # no chunk's result left for the next fill
            ref = _serial(ms, list(range(12)), 12, so.masks.words)  # and the next fill is right
            got = torch.zeros_like(ref)
            pool.fill(ms, got, list(range(12)))
            assert torch.equal(got, ref)
        with pytest.raises(ValueError, match="12 matchers but 11 indices"):
            pool.fill(ms, got, list(range(11)))
    finally:
        pool.close()
    assert not _workers()
    with pytest.raises(RuntimeError, match="after close"):
        pool.fill(ms, got, list(range(12)))
    pool.close()  # idempotent


def test_the_switch_routes_the_engine_fill_through_the_pool(walked, monkeypatch):
    base, _, _ = walked
    monkeypatch.setenv("PAGEDSERVE_GRAMMAR_FILL_POOL", "1")
    so = StructuredOutputs(base.tokenizer, base.vocab_size, set(base.stop_token_ids), torch.device("cpu"),
                           fill_threads=3)
    try:
        assert so._fill_pool is not None and so._fill_threaded == so._fill_pool.fill
        compiled = [so.pool.submit(s.key(), so.check(s)).result() for s in SPECS]
        gs = [so.seqs.start(i, compiled[i % 3]) for i in range(20)]
        tok = base.tokenizer
        texts = ['{"name": "x', "12-a", "om"]
        rows = [(2 * i, g, tok.encode(texts[i % 3][: i % 5], add_special_tokens=False), None)
                for i, g in enumerate(gs)]
        for k in (2, 11, 17):  # choice grammars that close now: their rows are left out
            rows[k] = (2 * k, gs[k], tok.encode("beta", add_special_tokens=False) + [tok.eos_token_id], None)
        mask = so.advance_and_fill(rows)
        assert [g.done for _, g, _, _ in rows].count(True) == 3
        live = [(i, g.matcher) for i, g, _, _ in rows if not g.done]
        ref = _serial([m for _, m in live], [i for i, _ in live], mask.rows, so.masks.words)
        assert mask.indices == [i for i, _ in live]
        for i in mask.indices:
            assert torch.equal(mask.bitmask[i], ref[i]), i
        assert len(_workers()) == 2
    finally:
        so.shutdown()
    assert not _workers()


def test_the_switch_is_checked_and_off_by_default(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_GRAMMAR_FILL_POOL", raising=False)
    assert not fill_pool_enabled()
    monkeypatch.setenv("PAGEDSERVE_GRAMMAR_FILL_POOL", "yes")
    with pytest.raises(ValueError, match="PAGEDSERVE_GRAMMAR_FILL_POOL must be 0 or 1"):
        fill_pool_enabled()
    with pytest.raises(ValueError, match="threads >= 2"):
        FillPool(1)
    with pytest.raises(ValueError, match="chunks_per_thread >= 1"):
        FillPool(2, 0)
