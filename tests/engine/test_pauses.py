"""engine/pauses.py: the start-up heap leaves the collector's walk; long pauses are logged on request."""
import asyncio
import gc
import logging
import time

import pytest

from pagedserve.engine import pauses


def test_freeze_moves_live_objects_out_of_collection():
    before = gc.get_freeze_count()
    keep = [object() for _ in range(1000)]
    try:
        frozen = pauses.freeze_startup_heap()
        # The count it reports is the one right after freezing; a frozen object can still die by
        # reference counting afterwards (a background thread an earlier test left, a frame), so
        # the count may only fall from there, and the 1000 live objects stay frozen.
        assert frozen >= gc.get_freeze_count() >= before + 1000
        # Frozen objects are no longer in any generation the collector walks.
        assert not any(o is keep[0] for o in gc.get_objects())
    finally:
        gc.unfreeze()


class _Node:
    pass


def test_heap_frozen_meanwhile_hides_old_objects_then_lets_their_garbage_go():
    import weakref
    gc.unfreeze()  # whatever an earlier test in this process left frozen
    old = _Node()
    old.self = old  # a cycle: only the collector can free it
    gone = weakref.ref(old)
    with pauses.heap_frozen_meanwhile():
        assert gc.get_freeze_count() > 0
        assert not any(o is old for o in gc.get_objects())
        young = _Node()
        assert any(o is young for o in gc.get_objects())
        del old
        gc.collect()
        assert gone() is not None  # frozen: not even a full collection reaches it
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gone() is None  # after the block its cycle is garbage like any other


def test_heap_frozen_meanwhile_leaves_someone_elses_freeze_alone():
    """Already frozen: the block neither freezes more nor unfreezes. (The frozen count itself may
    drop while it runs: frozen objects still die by reference counting.)"""
    frozen_before = _Node()
    gc.freeze()
    try:
        young = _Node()  # after the caller's freeze: collectable, and must stay so
        with pauses.heap_frozen_meanwhile():
            assert any(o is young for o in gc.get_objects())
        assert gc.get_freeze_count() > 0
        assert not any(o is frozen_before for o in gc.get_objects())
    finally:
        gc.unfreeze()


def test_serving_thresholds_leave_young_objects_to_reference_counting():
    """With CPython's 700 a young collection runs (and promotes what is alive) long before 10,000
    new container objects exist; with the serving thresholds none does."""
    before = gc.get_threshold()
    try:
        pauses.set_serving_gc_thresholds()
        assert gc.get_threshold() == pauses.SERVING_GC_THRESHOLDS
        gc.collect()
        keep = [[] for _ in range(10_000)]
        assert gc.get_count()[0] >= len(keep)
    finally:
        gc.set_threshold(*before)


def test_threshold_parsing(monkeypatch):
    monkeypatch.delenv(pauses.LOG_PAUSES_ENV, raising=False)
    assert pauses.pause_threshold_s() is None
    monkeypatch.setenv(pauses.LOG_PAUSES_ENV, "0")
    assert pauses.pause_threshold_s() is None
    monkeypatch.setenv(pauses.LOG_PAUSES_ENV, "250")
    assert pauses.pause_threshold_s() == 0.25
    monkeypatch.setenv(pauses.LOG_PAUSES_ENV, "slow")
    with pytest.raises(ValueError, match=pauses.LOG_PAUSES_ENV):
        pauses.pause_threshold_s()


def test_gc_pause_log_reports_collections_over_threshold(monkeypatch, caplog):
    monkeypatch.setenv(pauses.LOG_PAUSES_ENV, "0.000001")  # every collection is "long"
    n = len(gc.callbacks)
    try:
        assert pauses.install_gc_pause_log("test process")
        with caplog.at_level(logging.WARNING, logger=pauses.__name__):
            gc.collect()
        assert any("test process: gc generation 2 took" in r.getMessage() for r in caplog.records)
    finally:
        del gc.callbacks[n:]


def test_gc_pause_log_is_off_without_the_variable(monkeypatch):
    monkeypatch.delenv(pauses.LOG_PAUSES_ENV, raising=False)
    n = len(gc.callbacks)
    assert not pauses.install_gc_pause_log("test process")
    assert len(gc.callbacks) == n


def test_event_loop_watch_reports_a_blocked_loop(monkeypatch, caplog):
    monkeypatch.setenv(pauses.LOG_PAUSES_ENV, "50")

    async def main():
        watcher = asyncio.create_task(pauses.watch_event_loop("test server"))
        await asyncio.sleep(0.02)
        time.sleep(0.2)  # the loop cannot run its timer meanwhile
        await asyncio.sleep(0.05)
        watcher.cancel()

    with caplog.at_level(logging.WARNING, logger=pauses.__name__):
        asyncio.run(main())
    assert any("test server: event loop stalled" in r.getMessage() for r in caplog.records)


def test_llm_generate_runs_with_the_heap_frozen_and_gives_it_back(tiny_model_dir):
    """Offline generation keeps full collections off what existed before it (the model, every
    import), and leaves the collector as it found it."""
    from pagedserve import SamplingParams

    from .helpers import make_llm, prompt_ids
    model_dir = tiny_model_dir("llama")
    llm = make_llm(model_dir)
    gc.unfreeze()  # whatever an earlier test in this process left frozen
    seen = []
    get_output = llm.engine_core.get_output

    def watched(*a, **kw):
        seen.append(gc.get_freeze_count())
        return get_output(*a, **kw)
    llm.engine_core.get_output = watched
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids(model_dir)],
                        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert seen and all(n > 0 for n in seen)
    assert gc.get_freeze_count() == 0


class _Knot:
    """Cyclic garbage of a kind nothing else makes."""

    def __init__(self) -> None:
        self.me = self


class _Touchy(_Knot):
    """Garbage whose attribute lookups raise something other than AttributeError."""

    def __getattr__(self, name: str):
        raise RuntimeError(name)


def test_a_slow_collection_names_its_garbage_with_the_switch(monkeypatch, caplog):
    """PAGEDSERVE_LOG_GC_GARBAGE=1: the log line of a slow collection says what it collected
    (500 self-referencing objects, and 400 whose attribute lookups raise); without the switch
    it does not, and the collector frees it."""
    monkeypatch.setenv(pauses.LOG_PAUSES_ENV, "0.000001")
    n, debug = len(gc.callbacks), gc.get_debug()
    for keep in ("1", ""):
        monkeypatch.setenv(pauses.LOG_GC_GARBAGE_ENV, keep)
        caplog.clear()
        try:
            assert pauses.install_gc_pause_log("test process")
            knots = [_Knot() for _ in range(500)] + [_Touchy() for _ in range(400)]
            del knots
            with caplog.at_level(logging.WARNING, logger=pauses.__name__):
                gc.collect()
            lines = [r.getMessage() for r in caplog.records if "test process: gc generation 2" in r.getMessage()]
            assert lines
            if keep:
                assert f"{__name__}._Knot x500" in lines[-1] and f"{__name__}._Touchy x400" in lines[-1]
                assert sum(type(o) is _Knot for o in gc.garbage) == 500
            else:
                assert "garbage" not in lines[-1] and not any(isinstance(o, _Knot) for o in gc.garbage)
        finally:
            del gc.callbacks[n:]
            gc.set_debug(debug)
            gc.garbage.clear()


def test_describe_garbage_names_dicts_by_their_keys():
    """A dict in the garbage says whose it is by (up to four of) its keys, sorted."""
    messages = [{"type": "http.response.body", "body": b"", "more_body": True} for _ in range(3)]
    line = pauses.describe_garbage(messages + [{"z": 1}, _Knot()])
    assert line.startswith("dict[body,more_body,type] x3")
    assert "dict[z] x1" in line and f"{__name__}._Knot x1" in line
