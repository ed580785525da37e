"""pagedserve.core and the simulator stay pure Python: no torch import (docs/design.md)."""
import subprocess
import sys


def test_core_and_sim_do_not_import_torch():
    code = ("import sys, pagedserve.core.scheduler, pagedserve.core.contiguous, pagedserve.core.stats, "
            "pagedserve.sim, pagedserve.core.kv_state, pagedserve.dashboard.sim_app; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_the_front_ends_text_path_does_not_import_the_runner():
    """The API server's engine client and its text path (stop strings, detokenizing) need neither
    the runner nor torch; only the tokenizer's own load (transformers) may bring torch in."""
    code = ("import sys, pagedserve.engine.async_engine, pagedserve.engine.text_output; "
            "assert 'pagedserve.runner' not in sys.modules, 'the runner was imported'; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
