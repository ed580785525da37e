"""The mp backend: each replica is a local `pagedserve serve` process on 127.0.0.1.

The pool routes with a policy over the in-flight counts it keeps itself, forwards over
HTTP, and supervises: a replica whose process exits is marked down at once (its prefixes
forgotten), restarted with the same port and GPUs, and marked live when its /health
answers 200 again. A live replica's /health is asked every health_check_period seconds as well:
health_check_failures misses in a row (no 200 within health_check_timeout: a hung server, an
attached one that went away, a core that died while no request was there to find out) mark it
down until it answers again; a process that still runs is left running.

Faults: a request whose client has had nothing of it yet is sent to another replica: one that
could not be delivered (connection refused), one whose replica went away before answering
(non-stream) or before the first byte of its stream, one that a replica whose engine core died
(503 engine_dead) or whose queue is full (503 server_overloaded) refused. A stream whose replica
dies after its first byte ends with an SSE error event and [DONE]. No request hangs on a dead
replica.
"""
from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

import httpx
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagedserve.entrypoints.openai.serving_common import SSE_DONE, APIError, error_event, sse
from pagedserve.serving.pool import NoReplicaAvailable, ReplicaFailed, ReplicaResponse, one_chunk
from pagedserve.serving.relay_clients import RELAY_CLIENTS, Lost, NotDelivered, default_relay_client, make_relay

logger = logging.getLogger("pagedserve.dp")

def _error_code(body: bytes) -> str | None:
    """The code of a replica's OpenAI error body: engine_dead (its core is gone),
    server_overloaded (its admission queue is full), ..."""
    try:
        return json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the front end dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class LocalReplica:
    """One replica; cmd None: attached to a server someone else runs (never restarted)."""
    index: int
    cmd: list[str] | None
    env: dict[str, str]
    base_url: str
    proc: subprocess.Popen | None = None
    live: bool = False
    in_flight: int = 0
    routed: int = 0
    restarts: int = 0
    started_at: float = 0.0
    respawn_at: float | None = None   # set while down: when to start it again
    failures: list[str] = field(default_factory=list)
    missed_checks: int = 0            # live: /health checks in a row that got no 200
    next_check_at: float = 0.0
    check: asyncio.Task | None = None  # a live replica's /health check in flight

    @property
    def url(self) -> str:
        return self.base_url

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def spawn(self) -> None:
        if self.cmd is None:
            return
        self.proc = subprocess.Popen(self.cmd, env=self.env, preexec_fn=_die_with_parent)
        self.started_at = time.monotonic()
        self.live = False


class RelayingPool:
    """Forwards requests over HTTP to the replica a router picks; see the module docstring for
    the fault contract. Subclasses route: _acquire names a replica for a request and counts it
    in flight, _release ends that, _delivered counts it as routed, _down marks a replica failed.
    ProcessReplicaPool routes in this process; relay_worker.RemoteRoutedPool asks the process
    that owns the routing state (--api-server-count > 1)."""

    relay_client: str
    _relay = None  # relay_clients.HttpxRelay | AiohttpRelay, from start()
    # Sent with every relayed request: the replicas' own key (launch.py makes one per launch).
    replica_headers: dict[str, str] = {}

    async def _acquire(self, prefix_hashes: Sequence[bytes], tried: set[int]) -> tuple[int, str]:
        raise NotImplementedError

    def _release(self, index: int) -> None:
        raise NotImplementedError

    def _delivered(self, index: int) -> None:
        raise NotImplementedError

    def _down(self, index: int, why: str) -> None:
        raise NotImplementedError

    @staticmethod
    def _failed(index: int) -> ReplicaFailed:
        return ReplicaFailed(f"replica {index} failed while serving this request")

    async def forward(self, method: str, path: str, body: bytes,
                      prefix_hashes: Sequence[bytes]) -> ReplicaResponse:
        return await self._forward(method, path, body, prefix_hashes, set())

    async def _forward(self, method: str, path: str, body: bytes, prefix_hashes: Sequence[bytes],
                       tried: set[int]) -> ReplicaResponse:
        """Routes, relays, and retries on another replica whatever the client has had nothing of
        yet (tried: the replicas this request already failed on)."""
        relay = self._relay
        overloaded: ReplicaResponse | None = None
        while True:
            try:
                index, url = await self._acquire(prefix_hashes, tried)
            except NoReplicaAvailable:
                if overloaded is not None:  # every replica is full: its 503 and Retry-After
                    return overloaded
                raise
            try:
                resp = await relay.send(method, url + path, body, self.replica_headers)
            except (NotDelivered, Lost) as e:
                # Not delivered, or lost before any answer: the client has had nothing yet,
                # so the request goes to another replica.
                self._release(index)
                tried.add(index)
                self._down(index, f"{'connect failed' if isinstance(e, NotDelivered) else 'request lost'}: {e}")
                continue
            except BaseException:
                self._release(index)
                raise
            status, content_type = relay.head(resp)
            if content_type.startswith("text/event-stream"):
                self._delivered(index)

                def retry() -> Any:
                    return self._forward(method, path, body, prefix_hashes, tried)
                tried.add(index)  # (a retry of this stream never comes back here)
                return ReplicaResponse(status, content_type, self._stream(index, resp, retry))
            complete = False
            try:
                data = await relay.read(resp)
                complete = True
            except Lost as e:
                self._down(index, f"response lost: {e}")
                tried.add(index)
                continue  # nothing of it reached the client: another replica serves it
            finally:
                # Not complete (the client left and this task was cancelled, or the replica
                # went away): closing the connection tells the replica to abort the request.
                self._release(index)
                await relay.close(resp, complete=complete)
            code = _error_code(data) if status == 503 else None
            if code == "engine_dead":
                # The replica's engine core died: it answers 503 at once (and so looks least
                # loaded) for a few seconds before its process exits. The request never ran
                # there: take the replica out of routing and send the request elsewhere.
                tried.add(index)
                self._down(index, "its engine core died (503 engine_dead)")
                continue
            retry_after = relay.retry_after(resp)
            headers = {"Retry-After": retry_after} if retry_after else {}
            if code == "server_overloaded":  # its queue is full; the request never started there
                tried.add(index)
                overloaded = ReplicaResponse(status, content_type, one_chunk(data), headers)
                continue
            self._delivered(index)
            return ReplicaResponse(status, content_type, one_chunk(data), headers)

    async def _stream(self, index: int, resp, retry=None) -> AsyncIterator[bytes]:
        """The replica's bytes as they arrive. A replica lost before the first byte: the stream
        continues from another replica (retry()); lost later, it ends with an error event."""
        complete = sent = False
        lost = None
        try:
            async for chunk in self._relay.chunks(resp):
                sent = True
                yield chunk
            complete = True
        except Lost as e:
            self._down(index, f"stream lost: {e}")
            lost = e
        finally:
            self._release(index)
            await self._relay.close(resp, complete)
        if lost is None:
            return
        if not sent and retry is not None:
            try:
                again = await retry()
            except (NoReplicaAvailable, ReplicaFailed):
                again = None
            if again is not None:
                it = again.chunks
                try:
                    if again.content_type.startswith("text/event-stream"):
                        async for chunk in it:
                            yield chunk
                    else:  # an error answer (every replica full, ...): as the stream's error event
                        data = b"".join([c async for c in it])
                        yield (sse(data.decode(errors="replace")) + SSE_DONE).encode()
                finally:
                    await it.aclose()
                return
        err = APIError(str(self._failed(index)), 503, type="server_error", code="replica_failed")
        yield (error_event(err) + SSE_DONE).encode()


class ProcessReplicaPool(RelayingPool):
    """N local replica processes, routed and supervised here."""

    backend = "mp"

    def __init__(self, commands: Sequence[tuple[list[str], dict[str, str], int]], policy,
                 startup_timeout: float = 600.0, poll_interval: float = 0.2,
                 relay_client: str | None = None, replica_key: str | None = None,
                 health_check_period: float = 5.0, health_check_timeout: float = 5.0,
                 health_check_failures: int = 3) -> None:
        """commands: (argv, env, port) of each replica; argv must serve on 127.0.0.1:port.
        relay_client: aiohttp | httpx, the client that forwards requests (default:
        default_relay_client()); probes and /metrics always use httpx. replica_key: the
        replicas' API key, sent with every relayed request. health_check_*: how often a live
        replica's /health is asked, how long an answer may take, and how many misses in a row
        mark it down (at the defaults a hung replica stops getting requests within ~15-20 s;
        its /health needs no engine round trip, so a busy replica answers in time)."""
        if health_check_period <= 0 or health_check_timeout <= 0 or health_check_failures < 1:
            raise ValueError("health_check_period and health_check_timeout must be > 0 and "
                             f"health_check_failures >= 1, got {health_check_period}, "
                             f"{health_check_timeout}, {health_check_failures}")
        self.health_check_period = health_check_period
        self.health_check_timeout = health_check_timeout
        self.health_check_failures = health_check_failures
        self.replica_headers = {"Authorization": f"Bearer {replica_key}"} if replica_key else {}
        self.replicas = [LocalReplica(i, list(c), dict(e), f"http://127.0.0.1:{p}")
                         for i, (c, e, p) in enumerate(commands)]
        self.policy = policy
        self.startup_timeout = startup_timeout
        self.poll_interval = poll_interval
        self.relay_client = relay_client or default_relay_client()
        if self.relay_client not in RELAY_CLIENTS:
            raise ValueError(f"relay_client must be one of {RELAY_CLIENTS}, got {relay_client!r}")
        self._client: httpx.AsyncClient | None = None
        self._relay = None  # relay_clients.HttpxRelay | AiohttpRelay, from start()
        self._supervisor: asyncio.Task | None = None
        self.picks_by_api_server: dict[str, int] = {}  # front-end process -> requests it routed
        # Relay workers listening beside this process (relay_worker.RouteService keeps it).
        self.relay_workers_listening: set[str] = set()

    @classmethod
    def attach(cls, urls: Sequence[str], policy, **kwargs) -> "ProcessReplicaPool":
        """A pool over replica servers already running at urls (e.g. started by hand)."""
        pool = cls([], policy, **kwargs)
        pool.replicas = [LocalReplica(i, None, {}, u.rstrip("/")) for i, u in enumerate(urls)]
        return pool

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))  # probes, /metrics
        self._relay = make_relay(self.relay_client)
        for r in self.replicas:
            r.spawn()
        deadline = time.monotonic() + self.startup_timeout
        while not all(r.live for r in self.replicas):
            for r in self.replicas:
                if r.exited():
                    await self.stop()
                    raise RuntimeError(f"replica {r.index} exited with {r.proc.returncode} "
                                       "during start-up (its log is above)")
                if not r.live:
                    r.live = await self._probe(r)
            if time.monotonic() > deadline:
                await self.stop()
                raise RuntimeError(f"replicas not healthy within {self.startup_timeout:.0f} s")
            await asyncio.sleep(self.poll_interval)
        logger.info("all %d replicas live: %s", len(self.replicas),
                    ", ".join(r.url for r in self.replicas))
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())

    async def stop(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
        for r in self.replicas:
            if r.check is not None:
                r.check.cancel()
            if r.proc is not None and r.proc.poll() is None:
                r.proc.terminate()
        for r in self.replicas:
            if r.proc is not None:
                try:
                    await asyncio.to_thread(r.proc.wait, 15)
                except subprocess.TimeoutExpired:
                    r.proc.kill()
                    r.proc.wait()
            r.live = False
        if self._client is not None:
            await self._client.aclose()
        if self._relay is not None:
            await self._relay.aclose()

    async def _probe(self, r: LocalReplica, timeout: float = 2.0) -> bool:
        try:
            return (await self._client.get(r.url + "/health", timeout=timeout)).status_code == 200
        except httpx.HTTPError:
            return False

    def _check_live(self, r: LocalReplica) -> None:
        """Ask a live replica's /health when due, in a task of its own (a hung replica must not
        hold up the supervision of the others); health_check_failures misses in a row mark it down."""
        now = time.monotonic()
        if r.check is not None or now < r.next_check_at:
            return
        r.next_check_at = now + self.health_check_period

        async def check() -> None:
            try:
                if await self._probe(r, self.health_check_timeout):
                    r.missed_checks = 0
                    return
                r.missed_checks += 1
                if r.missed_checks >= self.health_check_failures:
                    self._mark_down(r, f"/health: no 200 within {self.health_check_timeout:g} s, "
                                       f"{r.missed_checks} checks in a row")
            finally:
                r.check = None
        r.check = asyncio.get_running_loop().create_task(check())

    def _mark_down(self, r: LocalReplica, why: str) -> None:
        if r.live:
            logger.warning("replica %d down: %s", r.index, why)
            r.failures.append(why)
        r.live = False
        r.missed_checks = 0
        self.policy.forget(r.index)

    async def _supervise(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            for r in self.replicas:
                try:
                    if r.exited() and r.respawn_at is None:
                        self._mark_down(r, f"process exited with {r.proc.returncode}")
                        # A replica that dies again soon after starting waits longer each time.
                        lived = time.monotonic() - r.started_at
                        delay = 0.0 if lived > 60 else min(30.0, 2.0 ** min(r.restarts, 5) - 1)
                        r.respawn_at = time.monotonic() + delay
                    if r.respawn_at is not None and time.monotonic() >= r.respawn_at:
                        r.respawn_at = None
                        r.restarts += 1
                        logger.warning("restarting replica %d (restart %d)", r.index, r.restarts)
                        r.spawn()
                    elif not r.live and await self._probe(r):
                        r.live = True
                        r.next_check_at = time.monotonic() + self.health_check_period
                        logger.info("replica %d live again", r.index)
                    elif r.live:
                        self._check_live(r)
                except Exception:  # the supervisor must outlive any one replica's trouble
                    logger.exception("supervising replica %d", r.index)

    # ---- requests ----------------------------------------------------------------------------

    def _pick(self, prefix_hashes: Sequence[bytes], tried: set[int]) -> LocalReplica:
        loads = {r.index: r.in_flight for r in self.replicas if r.live and r.index not in tried}
        if not loads:
            raise NoReplicaAvailable("no replica is live to serve this request; retry later")
        return self.replicas[self.policy.choose(prefix_hashes, loads)]

    async def _acquire(self, prefix_hashes: Sequence[bytes], tried: set[int]) -> tuple[int, str]:
        return self.acquire(prefix_hashes, tried)

    def acquire(self, prefix_hashes: Sequence[bytes], tried: set[int], api_server: str = "0") -> tuple[int, str]:
        """Route one request: its replica's index and URL, counted in flight until _release.
        api_server: the front-end process asking (relay_worker.py), counted for /health."""
        r = self._pick(prefix_hashes, tried)
        r.in_flight += 1
        self.picks_by_api_server[api_server] = self.picks_by_api_server.get(api_server, 0) + 1
        return r.index, r.url

    def _release(self, index: int) -> None:
        self.replicas[index].in_flight -= 1

    def _delivered(self, index: int) -> None:
        self.replicas[index].routed += 1

    def _down(self, index: int, why: str) -> None:
        self._mark_down(self.replicas[index], why)

    # ---- observability -----------------------------------------------------------------------

    async def health(self) -> dict:
        n_live = sum(r.live for r in self.replicas)
        status = "ok" if n_live == len(self.replicas) else "degraded" if n_live else "down"
        return {"status": status, "backend": self.backend, "relay_client": self.relay_client,
                "live_replicas": n_live, "routed_by_api_server": dict(self.picks_by_api_server),
                "api_servers_listening": ["0", *sorted(self.relay_workers_listening)], "replicas": [
                    {"replica": str(r.index), "live": r.live, "url": r.url,
                     "pid": r.proc.pid if r.proc else None, "in_flight": r.in_flight,
                     "routed": r.routed, "restarts": r.restarts} for r in self.replicas]}

    async def metrics_texts(self) -> dict[str, str]:
        async def one(r: LocalReplica) -> tuple[str, str | None]:
            try:
                resp = await self._client.get(r.url + "/metrics", timeout=5.0)
                return str(r.index), resp.text if resp.status_code == 200 else None
            except httpx.HTTPError:
                return str(r.index), None
        got = await asyncio.gather(*(one(r) for r in self.replicas if r.live))
        return {k: v for k, v in got if v is not None}

    def router_metrics(self) -> list[Metric]:
        live = GaugeMetricFamily("pagedserve:replica_live", "1 while the replica serves, 0 while "
                                 "it is down or restarting.", labels=["replica"])
        in_flight = GaugeMetricFamily("pagedserve:router_in_flight_requests",
                                      "Requests the router has in flight on the replica.",
                                      labels=["replica"])
        routed = CounterMetricFamily("pagedserve:router_routed_requests",
                                     "Requests the router sent to the replica.",
                                     labels=["replica", "policy"])
        restarts = CounterMetricFamily("pagedserve:replica_restarts", "Restarts of the replica.",
                                       labels=["replica"])
        for r in self.replicas:
            live.add_metric([str(r.index)], float(r.live))
            in_flight.add_metric([str(r.index)], r.in_flight)
            routed.add_metric([str(r.index), self.policy.name], r.routed)
            restarts.add_metric([str(r.index)], r.restarts)
        return [live, in_flight, routed, restarts]
