"""The shared server's log has one format in both processes, uvicorn's lines included
(pagedserve/log_setup.py), and INFO says what a user needs: the engine's one summary line and
where it serves; internal figures (file limits, HTTP stack, GC bookkeeping) stay at DEBUG."""
from __future__ import annotations

import re
import time

LINE = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d (api-server|engine-core): \S")


def log_lines(text: str) -> list[str]:
    """Lines written by a logger: all but the usage hint `serve` prints for the user (a
    'Serving ...' line, its indented examples, blank lines)."""
    return [ln for ln in text.splitlines()
            if ln.strip() and not ln.startswith(("Serving '", "  "))]


def test_one_format_and_info_for_users(server, http):
    assert http.get("/health").status_code == 200  # an access-log line, written by uvicorn
    deadline = time.monotonic() + 10  # uvicorn writes it once the response is sent
    while '"GET /health' not in (text := server.log_path.read_text(errors="replace")) and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = log_lines(text)
    bad = [ln for ln in lines if not LINE.match(ln)]
    assert not bad, bad[:5]
    assert sum("engine-core: engine ready: " in ln for ln in lines) == 1
    ready = next(ln for ln in lines if "engine ready: " in ln)
    assert "max_model_len 512" in ready and "KV cache 512 blocks of 16 tokens (8192 tokens)" in ready, ready
    assert any(re.search(r"api-server: serving tiny on http://127\.0\.0\.1:\d+/v1", ln) for ln in lines)
    assert any('"GET /health HTTP/1.1" 200' in ln for ln in lines)  # uvicorn's own lines, our format
    for internal in ("open-file limit", "HTTP parser", "froze"):
        assert not any(internal in ln for ln in lines), internal
