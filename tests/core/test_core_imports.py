"""pagedserve.core and the simulator stay pure Python: no torch import (docs/design.md)."""
import subprocess
import sys


def test_core_and_sim_do_not_import_torch():
    code = ("import sys, pagedserve.core.scheduler, pagedserve.core.contiguous, pagedserve.core.stats, "
            "pagedserve.sim, pagedserve.core.kv_state, pagedserve.dashboard.sim_app; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
