"""The open-file limit (RLIMIT_NOFILE) of HTTP servers and benchmark clients.

Every open HTTP connection is a file descriptor. A uvicorn server on uvloop that reaches its soft
limit cannot accept(): libuv then accepts and at once closes the connections waiting in the
listen queue (its EMFILE trick), so their clients, whose requests the kernel already took, get a
reset: httpx `ReadError` with an empty message (BrokenResourceError <- ConnectionResetError, or
BrokenPipeError). The server itself can stop working too: a lazy import or a ZMQ send that needs
a descriptor fails (seen on CPU with `prlimit --nofile=1200` and 1,600 streams at once: in one
run 1,366 of 1,600 failed, 425 with that ReadError and most others timing out once the server
stopped answering; another run, 481 and 432). The soft limit is often far below what the hard limit
allows (1024 against 524288 is common), so servers and benchmark clients raise it to the hard
limit at start-up, as vLLM does; what the hard limit itself allows is the host's business
(`ulimit -Hn`), and the servers log it.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# RLIM_INFINITY cannot be a soft RLIMIT_NOFILE (the kernel caps it at fs.nr_open, 1,048,576 by
# default), so an unlimited hard limit raises the soft one to this.
UNLIMITED_TARGET = 1 << 20


def raise_fd_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; returns the soft limit now.

    Never lowers it; where the OS refuses (or has no such limit), the limit stays as it was."""
    try:
        import resource
    except ImportError:  # not a POSIX system: no such limit to raise
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-file limit from %d to %d (%s)", soft, target, e)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft


def fd_limit_note(soft: int) -> str:
    """The start-up line servers log: the limit bounds the connections they can hold at once."""
    if soft < 0:
        return "open-file limit: none known"
    return (f"open-file limit {soft}: at most about that many connections at once (beyond it new ones "
            "are reset: clients see httpx ReadError); the hard limit (ulimit -Hn) bounds it")
