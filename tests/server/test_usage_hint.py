"""The commands `pagedserve serve` prints on start-up work as printed, API key or not."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pagedserve.entrypoints.openai.api_server import _usage_hint


def _commands(hint: str) -> list[str]:
    """The hint's shell commands (a line ending in a backslash continues on the next)."""
    lines = [line.strip() for line in hint.splitlines()[2:] if line.strip()]
    cmds, current = [], ""
    for line in lines:
        if line.startswith("#"):
            continue
        current += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            cmds.append(current)
            current = ""
    return cmds


def test_printed_examples_work_against_a_keyed_server(server):
    host, port = server.base_url.removeprefix("http://").split(":")
    hint = _usage_hint(server.model, host, int(port), keyed=True)
    assert server.api_key not in hint  # the key stays out of logs
    cmds = _commands(hint)
    assert [c.split()[0] for c in cmds] == ["curl", "python"]
    # `python` as a user's activated environment has it; the key as the hint says to set it.
    env = dict(os.environ, PAGEDSERVE_API_KEY=server.api_key,
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    for cmd in cmds:
        p = subprocess.run(["bash", "-c", cmd + (" --fail-with-body -s" if cmd.startswith("curl") else "")],
                           capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 0, (cmd, p.stdout, p.stderr)
        if cmd.startswith("curl"):
            assert '"choices"' in p.stdout, (cmd, p.stdout)
        else:  # print() ran on the reply's content, which the random tiny model may leave empty (an EOS
            # or whitespace first: make test failed on that once, 2026-12-04)
            assert p.stdout.endswith("\n"), (cmd, p.stdout)
    # Without the key the same commands are refused: the hint really does send it.
    env.pop("PAGEDSERVE_API_KEY")
    p = subprocess.run(["bash", "-c", cmds[0] + " --fail-with-body -s"], capture_output=True,
                       text=True, env=env, timeout=60)
    assert p.returncode != 0 and "invalid_api_key" in p.stdout
