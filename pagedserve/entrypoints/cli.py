"""`pagedserve serve | generate | bench | sim`.

Each subcommand lives in its own module and is imported only when used, so
`pagedserve sim` starts without torch. Errors a user can fix are one line on stderr
and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import os
import sys

from pagedserve import __version__
# Re-exported: older callers import the engine flags from here.
from pagedserve.engine_args import add_engine_args, engine_config_from_args  # noqa: F401


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: the usage of `serve` alone is a screenful."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> ArgumentParser:
    from pagedserve.entrypoints import commands

    parser = ArgumentParser(prog="pagedserve", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"pagedserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in ("serve", "generate", "bench", "sim"):
        getattr(commands, f"register_{name}")(sub)
    return parser


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command the user ran: `pagedserve bench serve`'s for its flags."""
    for dest in ("command", "bench_command"):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, dest, None)
        if not subs or name not in subs[0].choices:
            break
        parser = subs[0].choices[name]
    return parser


def _unrecognized(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """'unrecognized arguments: --max_model_len (did you mean --max-model-len?)': flags take dashes,
    as vLLM's; the closest known flag is named for each unknown one."""
    import difflib

    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    words = []
    for word in extras:
        flag = word.split("=", 1)[0]
        dashed = "--" + flag.lstrip("-").replace("_", "-")
        close = [dashed] if dashed in known else difflib.get_close_matches(dashed, known, n=1, cutoff=0.8)
        words.append(f"{word} (did you mean {close[0]}?)" if word.startswith("-") and close else word)
    return f"unrecognized arguments: {' '.join(words)}"


def main(argv: list[str] | None = None) -> int:
    from pagedserve.runner.dist_env import is_external_worker
    if is_external_worker():
        # torchrun started this command on every node: ranks > 0 serve rank 0's engine instead.
        from pagedserve.runner.launch import main as worker_main
        code = worker_main()
        # As launch.py's own entry does: skip the interpreter's finalization, where a library's
        # atexit hook or a gloo thread can block on groups already torn down. test_tp_env_rendezvous
        # once timed out with rank 0 done and node 0's torchrun waiting at its exit barrier for
        # this worker (cause not pinned down; finalization is the step launch.py already skips).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        command_parser = _command_parser(parser, args)
        command_parser.error(_unrecognized(extras, command_parser))
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"pagedserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
