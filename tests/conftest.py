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


@pytest.fixture(scope="session")
def interpreter_run(request):
    """interpreter_run(path) -> the CompletedProcess of that case file under TRITON_INTERPRET=1. The
    first call runs every marked case file of the session, in one pytest process per core (interpreter_runs.py)."""
    from pathlib import Path

    from interpreter_runs import CaseRun, InterpreterRuns
    runs = {}
    for item in request.session.items:
        mark = item.get_closest_marker("interpreter_cases")
        if mark is not None:
            path = Path(mark.args[0]).resolve()
            runs[path] = CaseRun(path, **mark.kwargs)
    pool = InterpreterRuns(list(runs.values()), jobs=len(os.sched_getaffinity(0)))
    yield pool
    pool.close()


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
