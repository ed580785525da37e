import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread, here and in every process a test starts (they inherit it). The tiny models
# gain nothing from a second one (tests/benchmark + tests/engine: 131 s either way on 2 idle cores),
# and with two, a core busy elsewhere stalls every op at its barrier: one test took 12 s alone and
# 515 s beside another CPU-bound process. Servers and replicas started by tests already set it.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A factory: tiny_model_dir(arch) -> path of a saved tiny HF model (cached per session)."""
    from tiny_models import make_tiny_model
    cache = {}

    def get(arch: str = "llama", **overrides):
        key = (arch, repr(sorted(overrides.items())))  # repr: values may be lists (layer_types)
        if key not in cache:
            cache[key] = make_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), **overrides)
        return cache[key]
    return get


def pytest_configure(config):
    config.addinivalue_line("markers", "interpreter_cases(path, env_drop=(), timeout=600): the test checks the "
                            "result of this Triton-interpreter case file (fixture interpreter_run)")


_INTERPRETER_RUNS = pytest.StashKey()


def pytest_collection_modifyitems(config, items):
    # The checks of the interpreter case files go last (a stable sort): their processes start at the
    # end of collection and run beside every other test (tests/interpreter_runs.py).
    items.sort(key=lambda item: item.get_closest_marker("interpreter_cases") is not None)


def pytest_collection_finish(session):
    """Starts every marked case file of the session now, one process per spare core (all the cores
    when no other test is collected), so that they are done when the run reaches their checks."""
    if session.config.option.collectonly:
        return
    from pathlib import Path

    from interpreter_runs import CaseRun, InterpreterRuns
    runs = {}
    for item in session.items:
        mark = item.get_closest_marker("interpreter_cases")
        if mark is not None:
            path = Path(mark.args[0]).resolve()
            runs[path] = CaseRun(path, **mark.kwargs)
    if not runs:
        return
    cores = len(os.sched_getaffinity(0))
    others = any(item.get_closest_marker("interpreter_cases") is None for item in session.items)
    pool = InterpreterRuns(list(runs.values()), jobs=cores - 1 if others else cores)
    pool.start()
    session.config.stash[_INTERPRETER_RUNS] = pool


def pytest_sessionfinish(session):
    pool = session.config.stash.get(_INTERPRETER_RUNS, None)
    if pool is not None:
        pool.close()


@pytest.fixture(scope="session")
def interpreter_run(request):
    """interpreter_run(path) -> the CompletedProcess of that case file under TRITON_INTERPRET=1 (the
    processes started at the end of collection; one started here for a file not collected)."""
    from interpreter_runs import InterpreterRuns
    pool = request.config.stash.get(_INTERPRETER_RUNS, None)
    if pool is None:
        pool = request.config.stash[_INTERPRETER_RUNS] = InterpreterRuns([], jobs=len(os.sched_getaffinity(0)))
    return pool


@pytest.fixture(autouse=True)
def _root_logger_restored():
    """A test that runs the CLI in this process (`main(["serve", ...])` reaching
    log_setup.configure_logging) points the root logger at that test's captured stderr, which
    pytest closes after it: every later INFO record (httpx logs each request) then printed a
    '--- Logging error ---' traceback into whichever test's stderr was being captured, and a test
    that wants one line of stderr failed, depending on test order."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
