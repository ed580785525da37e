"""More than one front-end process (`--api-server-count K`, mp backend): relays in parallel, one router.

One front end relays every streamed token of every replica, on one core. With K > 1 the
front end starts K - 1 relay workers (`python -m pagedserve.serving.relay_worker`); all K
listen on the same port (SO_REUSEPORT: the kernel spreads connections over them) and each
relays its own requests to the replicas directly. Routing stays in one place, the first front
end, which owns the replica pool (processes, supervision, policy, in-flight counts): a worker
asks it over ZMQ which replica takes a request and tells it when the request ends, so prefix
affinity and load balance are the same as with one front end. /health and /metrics on a
worker are the first front end's answers.

    front end 0 (launch.py): ProcessReplicaPool + RouteService (ROUTER on an ipc socket)
    relay worker k:          RemoteRoutedPool (DEALER) -> pick / release / delivered / down

A worker dies with the first front end (PR_SET_PDEATHSIG) and is restarted by it if it exits.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import socket
import subprocess
import sys
from typing import Any, Sequence

import msgspec
import zmq
import zmq.asyncio

from pagedserve.serving.dp_args import REPLICA_KEY_ENV
from pagedserve.serving.mp_pool import ProcessReplicaPool, RelayingPool
from pagedserve.serving.pool import NoReplicaAvailable
from pagedserve.serving.relay_clients import default_relay_client, make_relay

logger = logging.getLogger("pagedserve.dp")


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket that other processes may bind to the same address too.

    Not inheritable (Python's default): each process binds its own. A child that inherited a
    listener would keep it in the SO_REUSEPORT group after its owner died, and the kernel would
    go on queueing connections on it that nobody accepts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


class RouteService:
    """The first front end's router, answering its relay workers over a ZMQ ROUTER socket.

    Requests are msgpack lists [op, call_id, *args]; ops with a call id get [call_id, result].
    hello() (a worker is listening); pick(hashes, tried) -> [index, url] | None; release(index);
    delivered(index); down(index, why); health() -> dict; metrics() -> the merged /metrics text."""

    def __init__(self, pool: ProcessReplicaPool, address: str, metrics_text) -> None:
        self.pool, self.address, self.metrics_text = pool, address, metrics_text
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # No high-water marks: a ROUTER drops what it cannot queue, and no answer may be lost.
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        # A restarted worker reconnects under its predecessor's name: the name goes to it.
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._sock.bind(address)
        self._task: asyncio.Task | None = None
        self.ready = pool.relay_workers_listening  # workers that said hello: their socket listens
        # worker -> replica -> requests it picked and has not released: what a worker that dies
        # leaves counted in flight, released by forget_worker.
        self.outstanding: dict[str, dict[int, int]] = {}

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._sock.close(0)
        self._ctx.term()

    async def _serve(self) -> None:
        while True:
            ident, frame = await self._sock.recv_multipart()
            call_id = None
            try:
                op, call_id, *args = msgspec.msgpack.decode(frame)
                if op in ("health", "metrics"):  # they await replicas: answered off this loop's turn
                    asyncio.get_running_loop().create_task(self._answer_later(ident, op, call_id))
                    continue
                result = self._handle(ident, op, args)
            except Exception as e:  # a bad message must not stop the router
                logger.exception("route service: %r", e)
                result = {"error": repr(e)}
            if call_id is not None:
                await self._sock.send_multipart([ident, msgspec.msgpack.encode([call_id, result])])

    def _handle(self, ident: bytes, op: str, args: list) -> Any:
        if op == "pick":
            hashes, tried = args
            worker = ident.decode(errors="replace")
            try:
                index, url = self.pool.acquire(hashes, set(tried), api_server=worker)
            except NoReplicaAvailable:
                return None
            held = self.outstanding.setdefault(worker, {})
            held[index] = held.get(index, 0) + 1
            return [index, url]
        if op == "hello":
            self.ready.add(ident.decode(errors="replace"))
        elif op == "release":
            held = self.outstanding.get(ident.decode(errors="replace"), {})
            if held.get(args[0], 0) > 0:  # (a worker forgotten meanwhile releases nothing twice)
                held[args[0]] -= 1
                self.pool._release(args[0])
        elif op == "delivered":
            self.pool._delivered(args[0])
        elif op == "down":
            self.pool._down(args[0], args[1])
        else:
            raise ValueError(f"unknown op {op!r}")
        return None

    def forget_worker(self, worker: str) -> None:
        """A worker exited: its requests in flight ended with it; release them and forget it."""
        for index, count in self.outstanding.pop(worker, {}).items():
            for _ in range(count):
                self.pool._release(index)
        self.ready.discard(worker)

    async def _answer_later(self, ident: bytes, op: str, call_id: int) -> None:
        try:
            result = await self.pool.health() if op == "health" else await self.metrics_text()
        except Exception as e:  # the worker answers its client from this, not after a timeout
            logger.exception("route service: %s", op)
            result = {"status": "down", "error": repr(e)} if op == "health" else f"# error: {e!r}\n"
        await self._sock.send_multipart([ident, msgspec.msgpack.encode([call_id, result])])


class RemoteRoutedPool(RelayingPool):
    """A relay worker's pool: routing asked of the first front end, relaying done here."""

    backend = "mp"

    def __init__(self, route_address: str, worker_name: str, relay_client: str | None = None,
                 replica_key: str | None = None) -> None:
        self.route_address, self.worker_name = route_address, worker_name
        self.replica_headers = {"Authorization": f"Bearer {replica_key}"} if replica_key else {}
        self.relay_client = relay_client or default_relay_client()
        self._calls = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, self.worker_name.encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # releases are never dropped or held back
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.connect(self.route_address)
        self._relay = make_relay(self.relay_client)
        self._reader = asyncio.get_running_loop().create_task(self._read())
        # This process's socket is bound and listening (main binds it before serving): from now
        # the kernel may hand it connections, and the first front end may report ready.
        await self._call("hello")

    async def stop(self) -> None:
        self._reader.cancel()
        await self._relay.aclose()
        self._sock.close(0)
        self._ctx.term()

    async def _read(self) -> None:
        while True:
            call_id, result = msgspec.msgpack.decode(await self._sock.recv())
            fut = self._pending.pop(call_id, None)
            if fut is not None and not fut.done():
                fut.set_result(result)

    async def _call(self, op: str, *args) -> Any:
        call_id = next(self._calls)
        fut = asyncio.get_running_loop().create_future()
        self._pending[call_id] = fut
        await self._sock.send(msgspec.msgpack.encode([op, call_id, *args]))
        try:
            # The router answers within one turn of its loop; far longer means it is gone.
            return await asyncio.wait_for(fut, 30.0)
        except asyncio.TimeoutError:
            raise NoReplicaAvailable("the front end's router did not answer; retry later") from None
        finally:
            self._pending.pop(call_id, None)

    def _tell(self, op: str, *args) -> None:
        # No high-water mark, so the send completes at once; nothing to await.
        self._sock.send(msgspec.msgpack.encode([op, None, *args]), flags=zmq.NOBLOCK)

    async def _acquire(self, prefix_hashes: Sequence[bytes], tried: set[int]) -> tuple[int, str]:
        got = await self._call("pick", list(prefix_hashes), sorted(tried))
        if got is None:
            raise NoReplicaAvailable("no replica is live to serve this request; retry later")
        if isinstance(got, dict):
            raise RuntimeError(f"router: {got.get('error')}")
        return got[0], got[1]

    def _release(self, index: int) -> None:
        self._tell("release", index)

    def _delivered(self, index: int) -> None:
        self._tell("delivered", index)

    def _down(self, index: int, why: str) -> None:
        self._tell("down", index, why)

    async def health(self) -> dict:
        return await self._call("health")

    async def metrics_text(self) -> str:
        return await self._call("metrics")


class RelayWorkers:
    """The K - 1 relay worker processes of the first front end: started once the replicas are
    live, restarted if one exits, stopped with the front end."""

    def __init__(self, count: int, host: str, port: int, route_address: str, tokenizer: str | None,
                 block_size: int, max_request_bytes: int, api_key: str | None = None,
                 replica_key: str | None = None, allowed_hosts: list[str] | None = None,
                 shutdown_timeout: float = 10.0, chat_template: str | None = None,
                 http_flags: Sequence[str] = (), chat_template_content_format: str = "auto") -> None:
        """http_flags: the front end's TLS, root-path and CORS flags (http_options.http_argv).
        chat_template / chat_template_content_format: the replicas', so that the workers key
        chat requests by the ids the replicas render."""
        self.cmds = [[sys.executable, "-m", "pagedserve.serving.relay_worker", "--host", host, "--port", str(port),
                      "--route-address", route_address, "--name", str(k), "--block-size", str(block_size),
                      "--max-request-bytes", str(max_request_bytes), "--shutdown-timeout", str(shutdown_timeout),
                      *(["--allowed-hosts", *allowed_hosts] if allowed_hosts else []),
                      *(["--tokenizer", tokenizer] if tokenizer else []),
                      *(["--chat-template", chat_template] if tokenizer and chat_template else []),
                      *(["--chat-template-content-format", chat_template_content_format] if tokenizer else []),
                      *http_flags]
                     for k in range(1, count + 1)]
        # The workers check the API key too, and send the replicas' own: both go through their
        # environment, not their argv.
        self.env = dict(os.environ)
        self.env.pop("PAGEDSERVE_API_KEY", None)
        if api_key:
            self.env["PAGEDSERVE_API_KEY"] = api_key
        if replica_key:
            self.env[REPLICA_KEY_ENV] = replica_key
        self.procs: list[subprocess.Popen | None] = [None] * count
        self.restarts = 0
        self._watch: asyncio.Task | None = None
        self._route: RouteService | None = None

    def _spawn(self, i: int) -> None:
        from pagedserve.serving.mp_pool import _die_with_parent
        self.procs[i] = subprocess.Popen(self.cmds[i], env=self.env, preexec_fn=_die_with_parent)

    async def start(self, route: RouteService, timeout_s: float = 120.0) -> None:
        """Spawn the workers and wait until each has said hello (its socket listens), so that
        /health's "ok" means every front-end process can take connections."""
        self._route = route
        for i in range(len(self.cmds)):
            self._spawn(i)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while len(route.ready) < len(self.cmds):
            for i, proc in enumerate(self.procs):
                if proc.poll() is not None:
                    raise RuntimeError(f"relay worker {i + 1} exited with {proc.returncode} during start-up")
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"relay workers not ready within {timeout_s:.0f} s")
            await asyncio.sleep(0.1)
        self._watch = asyncio.get_running_loop().create_task(self._watch_loop())

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for i, proc in enumerate(self.procs):
                if proc is not None and proc.poll() is not None:
                    logger.warning("relay worker %d exited with %s: restarting it", i + 1, proc.returncode)
                    self._route.forget_worker(str(i + 1))
                    self.restarts += 1
                    self._spawn(i)

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            if proc is not None:
                try:
                    await asyncio.to_thread(proc.wait, 10)
                except subprocess.TimeoutExpired:
                    proc.kill()


def relay_worker_hooks(pool: ProcessReplicaPool, api_server_count: int, host: str, port: int,
                       tokenizer: str | None, block_size: int, max_request_bytes: int,
                       api_key: str | None, replica_key: str | None = None,
                       allowed_hosts: list[str] | None = None, shutdown_timeout: float = 10.0,
                       chat_template: str | None = None, http_flags: Sequence[str] = (),
                       chat_template_content_format: str = "auto") -> dict:
    """build_dp_app's after_start / before_stop for api_server_count > 1: the route service and
    the relay workers start once the replicas are live, and stop before they do."""
    import shutil
    import tempfile

    from pagedserve.serving.frontend import merged_metrics

    folder = tempfile.mkdtemp(prefix="pagedserve-route-")
    address = f"ipc://{folder}/route"
    workers = RelayWorkers(api_server_count - 1, host, port, address, tokenizer, block_size, max_request_bytes,
                           api_key, replica_key, allowed_hosts, shutdown_timeout, chat_template, http_flags,
                           chat_template_content_format)
    state: dict = {}

    async def after_start() -> None:
        state["route"] = RouteService(pool, address, lambda: merged_metrics(pool))
        state["route"].start()
        await workers.start(state["route"])

    async def before_stop() -> None:
        await workers.stop()
        if "route" in state:
            await state["route"].stop()
        shutil.rmtree(folder, ignore_errors=True)

    return {"after_start": after_start, "before_stop": before_stop}


def parse_worker_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line RelayWorkers gives each worker."""
    from pagedserve.config import CHAT_TEMPLATE_CONTENT_FORMATS
    p = argparse.ArgumentParser(description="a DP front end's relay worker (started by the front end)")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--route-address", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--tokenizer", default=None, help="for routing keys; none: token-id prompts only")
    p.add_argument("--chat-template", default=None, help="the replicas' --chat-template, for chat routing keys")
    p.add_argument("--chat-template-content-format", default="auto", choices=CHAT_TEMPLATE_CONTENT_FORMATS,
                   help="the replicas' --chat-template-content-format, for chat routing keys")
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--max-request-bytes", type=int, required=True)
    p.add_argument("--shutdown-timeout", type=float, default=10.0)
    p.add_argument("--allowed-hosts", nargs="+", default=None)
    from pagedserve.entrypoints.http_options import add_http_args
    add_http_args(p)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from pagedserve.entrypoints.http_server import make_server
    from pagedserve.serving.frontend import build_dp_app
    from pagedserve.serving.prefix_key import load_tokenizer_path

    args = parse_worker_args(argv)
    from pagedserve.log_setup import configure_logging
    configure_logging("relay")
    from pagedserve.entrypoints.fd_limit import raise_fd_limit
    raise_fd_limit()  # each connection is a descriptor: see fd_limit (the front end logs the limit)
    pool = RemoteRoutedPool(args.route_address, args.name, replica_key=os.environ.get(REPLICA_KEY_ENV))
    app = build_dp_app(pool, load_tokenizer_path(args.tokenizer, args.chat_template), args.block_size,
                       api_key=os.environ.get("PAGEDSERVE_API_KEY"), max_request_bytes=args.max_request_bytes,
                       allowed_hosts=args.allowed_hosts,
                       chat_template_content_format=args.chat_template_content_format)
    from pagedserve.entrypoints.http_options import add_cors, uvicorn_options
    add_cors(app, args)
    sock = reuse_port_socket(args.host, args.port)
    server = make_server(app, shutdown_timeout=args.shutdown_timeout, on_drain_timeout=app.state.drain.expire,
                         log_level="warning", **uvicorn_options(args))
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
