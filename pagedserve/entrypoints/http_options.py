"""vLLM's TLS, proxy and CORS flags of `serve`: --ssl-keyfile/--ssl-certfile/--ssl-ca-certs/
--ssl-cert-reqs (uvicorn terminates TLS), --root-path (the prefix a path-routing proxy strips) and
--allowed-origins/--allow-credentials/--allowed-methods/--allowed-headers (Starlette's CORS).

One difference from vLLM, on purpose: vLLM answers every origin by default (allowed origins
["*"]); here no CORS header is sent unless --allowed-origins names some. With "*", any web page a
user opens could read this server's answers through the browser, which the Host check
(middleware.HostCheckMiddleware, against DNS rebinding) exists to prevent. A vLLM command line
that passes the flags gets what it asks for.

Served by the single server and the data-parallel front end with its relay workers
(--api-server-count > 1: each worker gets them back as flags, http_argv); Ray Serve's proxy does
not take them yet (refused in one line).
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any


def _json_list(value: str) -> list[str]:
    try:
        out = json.loads(value)
    except ValueError:
        out = None
    if not isinstance(out, list) or not all(isinstance(x, str) for x in out):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, as '[\"*\"]', got {value!r}")
    return out


def add_http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ssl-keyfile", default=None, help="TLS private key file (with --ssl-certfile: serve https)")
    p.add_argument("--ssl-certfile", default=None, help="TLS certificate file")
    p.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify client certificates with")
    p.add_argument("--ssl-cert-reqs", type=int, default=0, choices=(0, 1, 2),
                   help="client certificates: 0 not asked, 1 optional, 2 required (Python's ssl.CERT_*)")
    p.add_argument("--root-path", default="",
                   help="the path prefix a path-routing proxy strips before forwarding (FastAPI's root_path)")
    p.add_argument("--allowed-origins", type=_json_list, default=[],
                   help="JSON list of origins CORS answers, as '[\"https://app.example.com\"]' or '[\"*\"]' "
                        "(default: none, unlike vLLM's [\"*\"]: see entrypoints/http_options.py)")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS: JSON list of methods")
    p.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS: JSON list of headers")


_DEFAULTS = (("ssl_keyfile", None), ("ssl_certfile", None), ("ssl_ca_certs", None), ("ssl_cert_reqs", 0),
             ("root_path", ""), ("allowed_origins", []), ("allow_credentials", False),
             ("allowed_methods", ["*"]), ("allowed_headers", ["*"]))


def asks_http_options(args: Any) -> list[str]:
    """The flags of this module that differ from their defaults, as typed."""
    return [f"--{k.replace('_', '-')}" for k, default in _DEFAULTS if getattr(args, k, default) != default]


def http_argv(args: Any) -> list[str]:
    """The same flags again, for a process that serves the same port (a relay worker)."""
    out: list[str] = []
    for k, default in _DEFAULTS:
        v = getattr(args, k, default)
        if v == default:
            continue
        flag = f"--{k.replace('_', '-')}"
        out += [flag] if v is True else [flag, json.dumps(v) if isinstance(v, list) else str(v)]
    return out


def check_http_args(args: Any) -> None:
    """One line for a combination that cannot serve, before any process starts."""
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together (the key and its certificate)")
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, flag)
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"--{flag.replace('_', '-')}: no such file: {path!r}")
    if args.ssl_cert_reqs and not args.ssl_ca_certs:
        raise ValueError("--ssl-cert-reqs needs --ssl-ca-certs (the CAs client certificates are checked against)")
    if args.root_path and (not args.root_path.startswith("/") or args.root_path.endswith("/")):
        raise ValueError(f"--root-path must start with / and not end with one, as '/llm', got {args.root_path!r}")


def uvicorn_options(args: Any) -> dict[str, Any]:
    """uvicorn.Config's keywords for the TLS flags (and root_path: the prefix proxied paths carry)."""
    out: dict[str, Any] = {"root_path": args.root_path}
    if args.ssl_keyfile:
        out.update(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                   ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs)
    return out


def scheme(args: Any) -> str:
    return "https" if args.ssl_keyfile else "http"


def add_cors(app: Any, args: Any) -> None:
    """Starlette's CORS middleware, outermost (a preflight needs no API key), when origins are given."""
    if args.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins,
                           allow_credentials=args.allow_credentials, allow_methods=args.allowed_methods,
                           allow_headers=args.allowed_headers)
