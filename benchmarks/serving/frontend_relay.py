"""Where the per-token (SSE event) ceiling is, on CPU alone: client, DP front end, replica HTTP.

No model and no GPU. Each replica is pagedserve's own API server (build_app + AsyncLLMEngine,
under uvicorn as `pagedserve serve` runs it) over a model-less engine core (FakeCore) that
emits one token for every running request every --token-delay-ms, on a fixed clock as a
core in its own process would (--replica minimal: a bare FastAPI stream of the same chunks
instead). Requests are token-id prompts, streamed, all sent at t=0. Two set-ups:

  client   the benchmark client (`pagedserve bench serve`'s run_benchmark) -> 1 replica
  relay    the client -> the real DP front end (build_dp_app, mp pool attached) -> 2 replicas

The servers' CPU seconds come from /proc (user + system) over the measured run, the client's
from its own processes (run_benchmark's client_cpu_s). The figure that matters is CPU
microseconds per event in each process: 1e6 / that is its ceiling in events per second of
one core, whatever else shares the machine. Events/s (wall) are printed too, but on a small
machine every process here competes for the same cores.

    python benchmarks/serving/frontend_relay.py --num-requests 1000 --output-len 100 --token-delay-ms 20
    python benchmarks/serving/frontend_relay.py --setup relay --num-client-processes 4 --out relay.json
    # before/after: the servers from another checkout, the same client
    git archive BASE pagedserve | tar -x -C /tmp/before
    python benchmarks/serving/frontend_relay.py --server-tree /tmp/before ...
    PAGEDSERVE_DP_RELAY_CLIENT=httpx python benchmarks/serving/frontend_relay.py --setup relay ...
    python benchmarks/serving/frontend_relay.py --http h11 ...   # every server on uvicorn's pure-Python parser
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def cpu_seconds(pid: int) -> float:
    # Imported here: a server role imports pagedserve from --server-tree, never this tree's first.
    from pagedserve.benchmark.server_process import process_cpu_seconds
    return process_cpu_seconds(pid)


# ---- the fake replica ------------------------------------------------------------------------

def fake_replica_app(token_delay_s: float):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    from pagedserve.entrypoints.openai.protocol import (CompletionChoice, CompletionResponse,
                                                        random_id)
    from pagedserve.entrypoints.openai.serving_common import SSE_DONE, sse, usage

    app = FastAPI()

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return JSONResponse({"object": "list", "data": [{"id": "bench", "object": "model",
                                                          "max_model_len": 4096,
                                                          "vocab_size": 32000}]})

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = json.loads(await request.body())
        n, prompt = int(body["max_tokens"]), body["prompt"]
        rid = random_id("cmpl")

        async def stream():
            # The real server builds one pydantic CompletionResponse per event: so does this.
            for i in range(n):
                if token_delay_s:
                    await asyncio.sleep(token_delay_s)
                else:
                    await asyncio.sleep(0)  # a real server yields to its loop between outputs
                yield sse(CompletionResponse(id=rid, model="bench", choices=[CompletionChoice(
                    index=0, text=" tok", logprobs=None,
                    finish_reason="length" if i == n - 1 else None)]))
            yield sse(CompletionResponse(id=rid, model="bench", choices=[],
                                         usage=usage(len(prompt), n)))
            yield SSE_DONE
        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return app


class FakeCore:
    """An engine core without a model, for the real API server (AsyncLLMEngine + build_app):
    every step_s, one token for every running request, as one EngineCoreOutputs (a real core
    also emits one batch per step). What it leaves out: the zmq hop and msgspec decoding."""

    def __init__(self, step_s: float) -> None:
        from pagedserve.engine.core_messages import Ready
        self.step_s = step_s
        self.ready = Ready(os.getpid(), 4096, 32000, 1 << 20, 0, 16, 4096, [2])
        self.pid = os.getpid()
        self.running: dict[str, list] = {}   # request id -> [prompt ids, max_tokens, generated]
        self.has_work: asyncio.Event | None = None

    async def add_request_async(self, request_id, prompt_token_ids, params, arrival_time,
                                prompt=None) -> None:
        self.running[request_id] = [prompt_token_ids, params.max_tokens or 16, 0]
        if self.has_work is None:
            self.has_work = asyncio.Event()
        self.has_work.set()

    def abort_requests(self, request_ids) -> None:
        for rid in request_ids:
            self.running.pop(rid, None)

    async def get_output_async(self):
        from pagedserve.engine.core_client import EngineCoreOutputs
        from pagedserve.outputs import CompletionOutput, RequestOutput
        if self.has_work is None:
            self.has_work = asyncio.Event()
        while not self.running:
            self.has_work.clear()
            await self.has_work.wait()
        # Steps on a fixed clock, as a core in its own process would run them, whatever this
        # process is busy with meanwhile.
        now = time.monotonic()
        self.next_step = max(getattr(self, "next_step", now) + self.step_s, now)
        await asyncio.sleep(self.next_step - now)
        outs = []
        for rid, st in list(self.running.items()):
            st[2] += 1
            done = st[2] >= st[1]
            outs.append(RequestOutput(rid, None, st[0], [CompletionOutput(
                0, "", [100 + st[2] % 1000], None, None, "length" if done else None)], done))
            if done:
                del self.running[rid]
        return EngineCoreOutputs(outs)

    async def call_utility_async(self, method, *args):
        return {}

    def dead_reason(self):
        return None

    def fail(self, error) -> None:
        pass

    def shutdown(self, timeout_s: float = 10.0) -> None:
        pass


def serve_fake_replica(port: int, token_delay_s: float, kind: str) -> None:
    import uvicorn
    if kind == "api":  # the real pagedserve API server over FakeCore
        from pagedserve.engine.async_engine import AsyncLLMEngine
        from pagedserve.entrypoints.openai.api_server import build_app
        app = build_app(AsyncLLMEngine(FakeCore(token_delay_s), None), "bench")
    else:
        app = fake_replica_app(token_delay_s)
    # The same uvicorn settings as `pagedserve serve` (loop and http "auto", unless --http).
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=5, http=HTTP)


def serve_frontend(port: int, urls: list[str], api_server_count: int = 1) -> None:
    import logging

    import uvicorn

    from pagedserve.serving.frontend import build_dp_app
    from pagedserve.serving.mp_pool import ProcessReplicaPool
    from pagedserve.serving.routing import make_policy
    pool = ProcessReplicaPool.attach(urls, make_policy("round-robin"))
    hooks = {}
    if api_server_count > 1:  # as run_dp_server_cli: relay workers on the same port (their http "auto")
        from pagedserve.serving.relay_worker import relay_worker_hooks, reuse_port_socket
        hooks = relay_worker_hooks(pool, api_server_count, "127.0.0.1", port, None, 16, 1 << 20, None)
    app = build_dp_app(pool, None, 16, **hooks)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # The same uvicorn settings as run_dp_server_cli (http "auto", unless --http).
    if api_server_count == 1:
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=5, http=HTTP)
    else:
        uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=5, http=HTTP)).run(
            sockets=[reuse_port_socket("127.0.0.1", port)])


# ---- the driver --------------------------------------------------------------------------------

SERVER_TREE: str | None = None  # --server-tree: the pagedserve the servers import
HTTP = "auto"  # --http: uvicorn's HTTP parser in every server (auto: httptools if installed)


def spawn(role: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    tree = ["--server-tree", SERVER_TREE] if SERVER_TREE else []
    return subprocess.Popen([sys.executable, __file__, *role, *tree, "--http", HTTP], env=env, cwd=ROOT)


class _Pid:
    """A process this driver did not start (a relay worker): measured, stopped with its parent."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def terminate(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> None:
        pass

    def kill(self) -> None:
        pass


def relay_worker_pids(parent: int) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]) == parent \
                    and b"relay_worker" in open(f"/proc/{pid}/cmdline", "rb").read():
                out.append(int(pid))
        except OSError:
            pass
    return sorted(out)


def wait_health(url: str, timeout: float = 60.0) -> None:
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/health", timeout=2)
            if r.status_code == 200 and (not r.content or r.json().get("status", "ok") == "ok"):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy within {timeout} s")


def run_setup(setup: str, args) -> dict:
    from pagedserve.benchmark.server_process import free_port
    from pagedserve.entrypoints.bench_serve import run_benchmark
    from pagedserve.workloads import WorkloadRequest

    n_replicas = 1 if setup == "client" else 2
    procs: dict[str, subprocess.Popen] = {}
    spies: list[subprocess.Popen] = []
    try:
        urls = []
        for i in range(n_replicas):
            port = free_port()
            procs[f"replica{i}"] = spawn(["--role", "replica", "--port", str(port),
                                          "--token-delay-ms", str(args.token_delay_ms),
                                          "--replica", args.replica])
            urls.append(f"http://127.0.0.1:{port}")
        for u in urls:
            wait_health(u)
        base = urls[0]
        if setup == "relay":
            port = free_port()
            procs["frontend"] = spawn(["--role", "frontend", "--port", str(port),
                                       "--replica-urls", ",".join(urls),
                                       "--api-server-count", str(args.api_server_count)])
            base = f"http://127.0.0.1:{port}"
            wait_health(base)
            for k, pid in enumerate(relay_worker_pids(procs["frontend"].pid)):
                procs[f"frontend{k + 1}"] = _Pid(pid)

        def requests(n: int) -> list[WorkloadRequest]:
            return [WorkloadRequest(prompt_token_ids=[3 + (i * 7 + j) % 1000 for j in range(args.prompt_len)],
                                    output_len=args.output_len, arrival_time=0.0)
                    for i in range(n)]

        asyncio.run(run_benchmark(base + "/v1", requests(16), "bench"))  # warm connections
        if args.profile_dir:  # py-spy on every server process, for the measured run only
            Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
            spies = [subprocess.Popen(["py-spy", "record", "--nonblocking", "--format", "raw",
                                       "-r", "200", "-o", f"{args.profile_dir}/{setup}-{k}.txt",
                                       "-p", str(p.pid)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL) for k, p in procs.items()]
            time.sleep(1.0)
        before = {k: cpu_seconds(p.pid) for k, p in procs.items()}
        t0 = time.monotonic()
        summary = asyncio.run(run_benchmark(base + "/v1", requests(args.num_requests), "bench",
                                            num_processes=args.num_client_processes))
        wall = time.monotonic() - t0
        cpu = {k: cpu_seconds(p.pid) - before[k] for k, p in procs.items()}
        # The client's CPU while sending (all its processes, none of their start-up).
        cpu["client"] = summary["client_cpu_s"]
    finally:
        for p in procs.values():
            p.terminate()
        for spy in spies if args.profile_dir else []:
            spy.wait(30)
        for p in procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    # Per request: output_len token events + the usage event + [DONE].
    events = summary["completed"] * (args.output_len + 2)
    out = {"setup": setup, "replica": args.replica, "server_tree": SERVER_TREE or str(ROOT),
           "api_server_count": args.api_server_count if setup == "relay" else None,
           "relay_client": os.environ.get("PAGEDSERVE_DP_RELAY_CLIENT", "default"),
           "num_requests": args.num_requests, "output_len": args.output_len,
           "token_delay_ms": args.token_delay_ms, "num_client_processes": args.num_client_processes,
           "completed": summary["completed"], "failed": summary["failed"], "wall_s": round(wall, 2),
           "events": events, "events_per_s": round(events / summary["duration_s"]),
           "output_tok_per_s": round(summary["output_throughput"]),
           "cpu_s": {k: round(v, 2) for k, v in cpu.items()},
           "cpu_us_per_event": {k: round(v / events * 1e6, 1) for k, v in cpu.items()},
           # With --api-server-count K: all K front-end processes together, per event.
           "frontends_cpu_us_per_event": round(sum(v for k, v in cpu.items() if k.startswith("frontend"))
                                               / events * 1e6, 1) if "frontend" in cpu else None,
           "ceiling_events_per_s_per_core": {k: round(events / v) if v > 0 else None
                                             for k, v in cpu.items()}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", default="driver", choices=["driver", "replica", "frontend"])
    ap.add_argument("--port", type=int)
    ap.add_argument("--replica-urls", default="")
    ap.add_argument("--api-server-count", type=int, default=1,
                    help="relay setup: front-end processes on the port (--api-server-count of the DP front end)")
    ap.add_argument("--setup", nargs="+", default=["client", "relay"], choices=["client", "relay"])
    ap.add_argument("--num-requests", type=int, default=400)
    ap.add_argument("--output-len", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--token-delay-ms", type=float, default=0.0)
    ap.add_argument("--num-client-processes", type=int, default=1)
    ap.add_argument("--replica", default="api", choices=["api", "minimal"],
                    help="api: pagedserve's own API server (build_app) over an engine core that "
                         "emits one token per running request every --token-delay-ms; minimal: "
                         "a bare FastAPI stream of the same chunks, each request on its own timer")
    ap.add_argument("--server-tree", default=None,
                    help="replicas and front end import pagedserve from this source tree")
    ap.add_argument("--profile-dir", default=None,
                    help="py-spy each server process (raw collapsed stacks in this folder)")
    ap.add_argument("--http", default="auto", choices=["auto", "httptools", "h11"],
                    help="uvicorn's HTTP parser in every server (the A/B of the GPU image, which lacked httptools)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    global HTTP
    HTTP = args.http
    if args.server_tree:
        # Servers import pagedserve from there (e.g. `git archive BASE | tar -x -C DIR`, for a
        # before/after); the client stays this tree's.
        global SERVER_TREE
        SERVER_TREE = str(Path(args.server_tree).resolve())
        if args.role != "driver":
            sys.path.insert(0, SERVER_TREE)
    if args.role == "replica":
        return serve_fake_replica(args.port, args.token_delay_ms / 1000, args.replica)
    if args.role == "frontend":
        return serve_frontend(args.port, args.replica_urls.split(","), args.api_server_count)
    results = []
    for setup in args.setup:
        r = run_setup(setup, args)
        results.append(r)
        print(json.dumps(r), flush=True)
    print(f"\n{'setup':<8}{'K':>3}{'fe':>3}{'events/s':>10}" + "".join(
        f"{k + ' us/ev':>18}" for k in ("client", "frontend", "all front ends", "replica0", "replica1")))
    for r in results:
        us = {**r["cpu_us_per_event"], "all front ends": r["frontends_cpu_us_per_event"]}
        print(f"{r['setup']:<8}{r['num_client_processes']:>3}{r['api_server_count'] or '-':>3}{r['events_per_s']:>10}"
              + "".join(f"{us.get(k) if us.get(k) is not None else float('nan'):>18}"
                        for k in ("client", "frontend", "all front ends", "replica0", "replica1")))
    if args.out:  # through the one result writer: the commit and the switches go in
        from pagedserve.benchmark.results import write_result
        config = {k: getattr(args, k) for k in ("setup", "num_requests", "output_len", "prompt_len",
                                                "token_delay_ms", "num_client_processes", "replica", "server_tree", "http",
                                                "api_server_count")}
        config["relay_client_env"] = os.environ.get("PAGEDSERVE_DP_RELAY_CLIENT")
        write_result(args.out, "frontend_relay", "python benchmarks/serving/frontend_relay.py " + " ".join(sys.argv[1:]),
                     config, {"setups": results}, {}, {}, device="cpu")


if __name__ == "__main__":
    main()
