"""One start-up log format for every pagedserve process, uvicorn's lines included:

    INFO 12-01 15:21:46 api-server: serving pagedserve-demo on http://127.0.0.1:8000/v1

level, time, the process's role (api-server, engine-core, ...), the message. INFO says what a
user needs (what is served where, the model and its KV cache, how long start-up phases took);
internal figures (file limits, the HTTP stack, garbage-collector bookkeeping) are DEBUG.
PAGEDSERVE_LOGGING_LEVEL (vLLM's VLLM_LOGGING_LEVEL) sets the level: DEBUG shows them.
"""
from __future__ import annotations

import logging
import os

LEVEL_ENV = "PAGEDSERVE_LOGGING_LEVEL"
DATE_FORMAT = "%m-%d %H:%M:%S"


def log_format(role: str) -> str:
    return f"%(levelname)s %(asctime)s {role}: %(message)s"


def configure_logging(role: str) -> None:
    """The root logger writes every record (pagedserve's and uvicorn's, which propagate when
    uvicorn is given log_config=None) to stderr in the one format, at $PAGEDSERVE_LOGGING_LEVEL."""
    level = os.environ.get(LEVEL_ENV, "INFO").strip().upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"{LEVEL_ENV} must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {level!r}")
    logging.basicConfig(level=level, format=log_format(role), datefmt=DATE_FORMAT, force=True)
