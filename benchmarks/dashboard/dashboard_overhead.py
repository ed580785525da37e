"""Serving throughput with the KV dashboard open vs closed (issue #17: at most a 2% drop).

Starts one `pagedserve serve`, then replays the same workload in rounds that alternate
closed (nobody watching) and open (a viewer on /kv_cache/events, the stream the page reads,
or the real page in headless chromium with --viewer browser), so drift hits both alike.
Reports the median output throughput of each (over the whole run, and while requests still
waited: see _throughputs), the drops, and the frames per second the
viewer received under load (the issue asks >= 2 Hz): the load starts once the viewer has its
first frame, and only the frames that arrived while it ran count, over the time it ran.
With --toggle S there are no rounds: one long run, the viewer opened and closed every S seconds,
and the drop per open segment against its closed neighbours (toggled_run), which the drift
between rounds does not reach.

CPU (demo model):  python benchmarks/dashboard/dashboard_overhead.py --device cpu
H200: the demo model is host-bound there, the case where host-side work costs the most; its
KV cache is capped at 65,536 blocks, the size of Qwen3-0.6B's cache on an H200:
    python benchmarks/dashboard/dashboard_overhead.py --device cuda --rounds 3 --num-requests 3000 \\
        --serve-args "--num-gpu-blocks-override 65536" \\
        --output benchmarks/results/h200/dashboard_overhead.json
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pagedserve.benchmark.server_process import stop_process, wait_until_ready  # noqa: E402
from pagedserve.dashboard.feed import DEFAULT_STREAM_INTERVAL_S  # noqa: E402
from pagedserve.engine.step_trace import STEP_TRACE_ENV  # noqa: E402
from pagedserve.entrypoints.bench_serve import FD_MARGIN, run_benchmark  # noqa: E402
from pagedserve.entrypoints.bench_stats import tokens_between  # noqa: E402
from pagedserve.workloads import make_workload  # noqa: E402

KEY = "sk-dashboard-overhead"
MODEL = "bench"  # the served model name the requests ask for
# A request whose connection failed before any status line is sent once more (bench_serve's
# send_request) and counted in `retried`: at 1246ea2 a 60,000-request toggle run on the H200 lost 11
# that way (ReadError, no OS error beneath; the server logged no response to them), and any
# failure voids the comparison. A failure after a response still does.
RETRIES = 1


class SSEViewer:
    """Reads the dashboard's event stream in its own process, as an open page would (the
    benchmark client's process stays undisturbed). __enter__ returns once the viewer has its
    first (full) frame, so its start-up (a Python process, httpx, the first 65,536 states) is not
    counted against the load; the frames are counted over the load's own window (result())."""

    def __init__(self, base_url: str, interval: float) -> None:
        self.url = f"{base_url}/kv_cache/events?interval={interval}"
        self.arrivals: list[tuple[float, float]] = []  # (time.monotonic() at arrival, snapshot_s)

    def __enter__(self) -> "SSEViewer":
        self._proc = subprocess.Popen([sys.executable, __file__, "--sse-viewer", self.url],
                                      stdout=subprocess.PIPE, text=True)
        self._first = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._first.wait(120):
            self._proc.kill()
            raise SystemExit(f"the SSE viewer got no first frame from {self.url}")
        return self

    def _read(self) -> None:  # one reader for all its output: no line lost between two readers
        for line in self._proc.stdout:
            if line.startswith("["):
                self.arrivals.append(tuple(json.loads(line)))
                self._first.set()

    def __exit__(self, *exc) -> None:
        self._proc.send_signal(signal.SIGINT)
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # a SIGINT inside httpx's read can be lost
            self._proc.kill()
        self._reader.join(timeout=10)

    def result(self, t0: float, t1: float) -> dict:
        """Frames that arrived while the load ran (monotonic t0..t1: one clock for all processes
        on Linux), per second of that window; the gaps between them; the engine-thread time the
        snapshots behind them took, as a share of the window."""
        got = [(t, cost) for t, cost in self.arrivals if t0 <= t <= t1]
        gaps = sorted(b[0] - a[0] for a, b in zip(got, got[1:]))
        window = t1 - t0
        return {"viewer_frames": len(got), "viewer_window_s": round(window, 3),
                "viewer_hz": len(got) / window,
                "viewer_first_frame_before_load_s": round(t0 - self.arrivals[0][0], 3) if self.arrivals else None,
                "viewer_gap_s": {"p50": round(statistics.median(gaps), 3), "max": round(gaps[-1], 3)} if gaps else None,
                "snapshot_time_share": sum(cost for _, cost in got) / window}


def _sse_viewer_main(url: str) -> int:
    """Prints [arrival, snapshot_s] as each frame arrives: the first tells the parent to start the
    load, and what it saw survives however it is stopped."""
    try:
        with httpx.stream("GET", url, headers={"Authorization": f"Bearer {KEY}"}, timeout=None) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    frame = json.loads(line[5:])  # the page parses every frame too
                    print(json.dumps([time.monotonic(), frame.get("snapshot_s", 0.0)]), flush=True)
    except (KeyboardInterrupt, httpx.HTTPError):
        pass
    return 0


class BrowserViewer:
    """The real page in headless chromium (the system one); frames = versions it rendered."""

    def __init__(self, base_url: str, interval: float) -> None:
        self.url = f"{base_url}/dashboard?interval={interval}#key={KEY}"
        self.frames = 0

    def __enter__(self) -> "BrowserViewer":
        from playwright.sync_api import sync_playwright
        chromium = os.environ.get("PAGEDSERVE_CHROMIUM", "/usr/bin/chromium")
        self._pw = sync_playwright().start()
        self._browser = self._pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        self._page = self._browser.new_page()
        self._page.add_init_script("window.__frames = 0; new MutationObserver(() => window.__frames++)"
                                   ".observe(document.documentElement, {attributes: true, subtree: true, "
                                   "attributeFilter: ['data-version']});")
        self._page.goto(self.url)
        self._page.wait_for_function("document.body.dataset.status === 'live'", timeout=60_000)
        self._start = self._page.evaluate("window.__frames")
        return self

    def __exit__(self, *exc) -> None:
        self.frames = self._page.evaluate("window.__frames") - self._start
        self._browser.close()
        self._pw.stop()

    def result(self, t0: float, t1: float) -> dict:
        """Versions rendered from just before the load to just after it (the page's own clock is
        not comparable with t0, t1), per second of the load's window."""
        return {"viewer_frames": self.frames, "viewer_window_s": round(t1 - t0, 3),
                "viewer_hz": self.frames / (t1 - t0), "snapshot_time_share": float("nan")}


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--port", str(args.port),
           "--device", args.device, "--api-key", KEY, "--served-model-name", MODEL, *shlex.split(args.serve_args)]
    if args.model:
        cmd.insert(4, args.model)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    # The server's log is kept: when requests fail, it says what the server saw.
    with open(args.server_log, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    print(f"server log: {args.server_log}", file=sys.stderr, flush=True)
    base = f"http://127.0.0.1:{args.port}"
    try:
        wait_until_ready(proc, base + "/health", 600, interval=0.5, log_path=Path(args.server_log))
    except RuntimeError as e:
        stop_process(proc)
        raise SystemExit(f"{e}: {' '.join(cmd)}") from None
    return proc, base


def check_server_fd_limit(in_flight: int) -> None:
    """The server raises its open-file limit to the hard one, which it inherits from here: with
    more connections at once than that, uvloop resets the excess (httpx ReadError: see
    pagedserve/entrypoints/fd_limit.py), and the run would measure that. Refuse before starting."""
    import resource
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and in_flight + FD_MARGIN > hard:
        raise SystemExit(f"{in_flight} requests in flight need {in_flight + FD_MARGIN} open files in the "
                         f"server, whose hard limit here is {hard} (ulimit -Hn): pass a lower --max-concurrency")


def _throughputs(s: dict) -> dict:
    # backlog: the output rate until the last request got its first token (bench_serve), i.e. while
    # the engine still had requests waiting. The whole run's rate also holds the drain, whose length
    # is set by whichever long requests happen to start last, and varied by +-18% between rounds on
    # the H200; the engine's throughput under load is the backlog rate. It means something only
    # when requests outnumber the batch limit (3000 against 1024 on the H200): with fewer, every
    # request starts at once and the window is one prefill long.
    backlog = (s.get("backlog") or {}).get("output_throughput", float("nan"))
    return {"output_throughput": s["output_throughput"], "backlog_output_throughput": backlog,
            "duration_s": s["duration_s"], "failed": s["failed"], "retried": s.get("retried", 0)}


def one_round(base: str, requests, viewer_cls, interval: float) -> dict:
    if viewer_cls is None:
        return _throughputs(asyncio.run(run_benchmark(base + "/v1", requests, MODEL, api_key=KEY, retries=RETRIES)))
    with viewer_cls(base, interval) as viewer:  # returns once the viewer shows its first frame
        t0 = time.monotonic()
        s = asyncio.run(run_benchmark(base + "/v1", requests, MODEL, api_key=KEY, retries=RETRIES))
        t1 = time.monotonic()
    return {**_throughputs(s), **viewer.result(t0, t1)}


def toggled_run(base: str, requests, viewer_cls, interval: float, segment_s: float,
                client_processes: int, max_concurrency: int | None = None) -> dict:
    """One long run (every request at t=0) while a viewer is opened and closed in turn, segment_s
    seconds each, closed first. Each segment's rate is the output tokens that reached the client
    during it (its processes' own clocks: bench_stats.tokens_between). Unlike whole rounds, the two
    conditions meet the same load moments apart, so the drift between rounds (+-10% on the
    H200) cancels. The servers' /metrics is not the instrument: with the API server the
    bottleneck, its counters lag and a scrape takes seconds.

    A segment counts when it lies between the run's first token and the last request's first
    token (requests still queued: the server saturated) and is not the first (whose rate holds the
    first batch's prompt burst). The drop is, per open segment between two counted closed ones,
    1 - open / mean(closed neighbours): the median of those. An open segment starts once the
    viewer has its first (full) frame: what it measures is a page left open (diff frames), not
    the page's opening."""
    spans: list[tuple[bool, float, float, dict]] = []
    done = threading.Event()
    errors: list[BaseException] = []

    def toggle() -> None:
        try:
            i = 0
            while not done.is_set():
                viewer = viewer_cls(base, interval) if i % 2 else None
                if viewer is not None:
                    viewer.__enter__()
                try:
                    t0, u0 = time.perf_counter(), time.time()
                    done.wait(segment_s)
                    t1, u1 = time.perf_counter(), time.time()
                finally:
                    if viewer is not None:
                        viewer.__exit__(None, None, None)
                if t1 - t0 > 0.1:  # not the stub cut short by the run's end
                    seen = viewer.result(t0, t1) if viewer else {}
                    # Unix times too: the engine's step trace (engine_segment_rates) keeps those
                    spans.append((viewer is not None, t0, t1, {"start_unix": u0, "end_unix": u1, **seen}))
                i += 1
        except BaseException as e:  # surfaces in the main thread
            errors.append(e)

    thread = threading.Thread(target=toggle, daemon=True)
    thread.start()
    try:
        summary = asyncio.run(run_benchmark(base + "/v1", requests, MODEL, api_key=KEY, retries=RETRIES,
                                            num_processes=client_processes, keep_itl=True,
                                            max_concurrency=max_concurrency))
    finally:
        done.set()
        thread.join(timeout=120)
    if errors:
        raise errors[0]
    records, start = summary.pop("requests"), summary["start_monotonic"]
    firsts = [r["sent_at"] + r["ttft"] for r in records if r["error"] is None and r["ttft"] is not None]
    segments = []
    for i, (opened, t0, t1, seen) in enumerate(spans):
        a, b = t0 - start, t1 - start  # seconds from the run's start, the records' clock
        segments.append({"index": i, "open": opened, "start_s": round(a, 3), "seconds": round(b - a, 3),
                         "output_tok_s": tokens_between(records, a, b) / (b - a),
                         "counted": bool(firsts) and i > 0 and min(firsts) <= a and b <= max(firsts),
                         **seen})
    failed = [r["error"] for r in records if r["error"]]
    return {"summary": {**_throughputs(summary), "first_error": failed[0] if failed else None,
                        "errors": summary["errors"]},
            "segments": segments, **toggle_drop(segments)}


def toggle_drop(segments: list[dict], key: str = "output_tok_s") -> dict:
    """The paired drop of segments' `key` rate (toggled_run's docstring) and, beside it, the
    medians of each kind."""
    counted = {s["index"]: s for s in segments if s["counted"]}
    pairs = []
    for i, s in counted.items():
        left, right = counted.get(i - 1), counted.get(i + 1)
        if s["open"] and left and right and not left["open"] and not right["open"] \
                and left[key] + right[key] > 0:
            pairs.append(1 - s[key] / ((left[key] + right[key]) / 2))
    opened = [s[key] for s in counted.values() if s["open"]]
    closed = [s[key] for s in counted.values() if not s["open"]]
    # The pairs scatter (a 3 s segment's rate moves with the prefills it happens to hold): beside
    # the median, the mean and its normal 95% interval say how sure the figure is.
    half = 1.96 * statistics.stdev(pairs) / len(pairs) ** 0.5 if len(pairs) > 1 else None
    mean = statistics.fmean(pairs) if pairs else None
    return {"paired_drops": pairs, "paired_drop_median": statistics.median(pairs) if pairs else None,
            "paired_drop_mean": mean,
            "paired_drop_mean_ci95": None if half is None else [mean - half, mean + half],
            "open_segment_tok_s_median": statistics.median(opened) if opened else None,
            "closed_segment_tok_s_median": statistics.median(closed) if closed else None,
            "viewer_hz_min_segments": min((s["viewer_hz"] for s in counted.values() if s["open"]), default=None)}


def engine_segment_rates(steps: list[dict], segments: list[dict]) -> None:
    """Adds to each segment the engine's own rate from its step trace (engine/step_trace.py, one
    dict per step): `engine_decode_tok_s`, the decode tokens of the steps launched within the
    segment's Unix times over its length, and `engine_mean_seqs`, their mean batch. Unlike the
    tokens reaching the client, this is not moved by the client's or the API server's pace
    except through the batch they keep fed, which engine_mean_seqs shows. Decode tokens leave out
    each request's first token (its prefill's), about one in the workload's mean output length."""
    for seg in segments:
        inside = [st for st in steps if seg["start_unix"] <= st["t"] < seg["end_unix"]]
        seconds = seg["end_unix"] - seg["start_unix"]
        seg["engine_decode_tok_s"] = sum(st["decodes"] for st in inside) / seconds
        seg["engine_mean_seqs"] = sum(st["seqs"] for st in inside) / len(inside) if inside else 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model dir (default: the bundled demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--workload", default="alpaca-like")
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--max-total-len", type=int, default=1024, help="drop requests longer than this")
    p.add_argument("--rounds", type=int, default=3, help="pairs of closed/open runs")
    p.add_argument("--viewer", choices=["sse", "browser"], default="sse")
    p.add_argument("--interval", type=float, default=DEFAULT_STREAM_INTERVAL_S,
                   help="the stream's period in seconds (default: the page's)")
    p.add_argument("--port", type=int, default=18917)
    p.add_argument("--serve-args", default="", help="extra `pagedserve serve` flags, one string")
    p.add_argument("--server-log", default=os.path.join(tempfile.gettempdir(), "dashboard_overhead_server.log"),
                   help="where the server's output goes")
    p.add_argument("--output", default=None)
    p.add_argument("--toggle", type=float, default=None, metavar="SECONDS",
                   help="instead of rounds: one long run, the viewer opened and closed every SECONDS "
                        "(toggled_run); the drop from the tokens that reached the client in each segment")
    p.add_argument("--client-processes", type=int, default=1, help="with --toggle: client processes")
    p.add_argument("--max-concurrency", type=int, default=None, help="with --toggle: requests in flight at most")
    p.add_argument("--summarize", default=None, metavar="RESULT_JSON",
                   help="print a --toggle result's drops again (the client's and, with a step trace, the "
                        "engine's: median, mean and its 95%% interval) from its segments, and exit")
    args = p.parse_args()
    if args.summarize:
        segments = json.loads(Path(args.summarize).read_text())["results"]["segments"]
        keys = ["output_tok_s"] + (["engine_decode_tok_s"] if "engine_decode_tok_s" in segments[0] else [])
        print(json.dumps({k: {n: v for n, v in toggle_drop(segments, k).items() if n != "paired_drops"}
                          for k in keys}, indent=1))
        return 0

    model_dir = args.model or str(__import__("pagedserve.demo_model", fromlist=["DEMO_MODEL_DIR"]).DEMO_MODEL_DIR)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    requests = [dataclasses.replace(r, prompt_token_ids=[t % vocab for t in r.prompt_token_ids])
                for r in make_workload(args.workload, args.num_requests, None, seed=0)
                if len(r.prompt_token_ids) + r.output_len <= args.max_total_len]
    viewer_cls = SSEViewer if args.viewer == "sse" else BrowserViewer
    check_server_fd_limit(min(len(requests), args.max_concurrency or len(requests)) if args.toggle else len(requests))
    proc, base = start_server(args)
    if args.toggle:
        return toggle_main(args, proc, base, requests, viewer_cls, model_dir)
    try:
        one_round(base, requests[: max(8, len(requests) // 8)], None, args.interval)  # warm-up
        closed, opened = [], []
        for i in range(args.rounds):
            # Alternate which goes first, so slow drift does not favour either.
            order = [(closed, None), (opened, viewer_cls)]
            for runs, cls in order if i % 2 == 0 else reversed(order):
                runs.append(one_round(base, requests, cls, args.interval))
                print(("open  " if cls else "closed"), json.dumps(runs[-1]), flush=True)
    finally:
        stop_process(proc)
    if any(r["failed"] for r in closed + opened):
        raise SystemExit("some requests failed: the comparison would be meaningless")
    c = statistics.median(r["output_throughput"] for r in closed)
    o = statistics.median(r["output_throughput"] for r in opened)
    cb = statistics.median(r["backlog_output_throughput"] for r in closed)
    ob = statistics.median(r["backlog_output_throughput"] for r in opened)
    result = {"closed_output_tok_s": c, "open_output_tok_s": o, "drop": (c - o) / c,
              "closed_backlog_tok_s": cb, "open_backlog_tok_s": ob, "backlog_drop": (cb - ob) / cb,
              "viewer_hz_min": min(r["viewer_hz"] for r in opened),
              "snapshot_time_share_max": max(r["snapshot_time_share"] for r in opened),
              "closed": closed, "open": opened}
    print(f"closed {c:.1f} tok/s, open {o:.1f} tok/s: drop {100 * result['drop']:.2f}%; while requests waited "
          f"closed {cb:.1f}, open {ob:.1f}: drop {100 * result['backlog_drop']:.2f}% "
          f"(viewer got >= {result['viewer_hz_min']:.2f} frames/s under load; snapshots took "
          f"<= {100 * result['snapshot_time_share_max']:.3f}% of the engine thread's time)")
    if args.output:  # through the one result writer: the commit and the engine's switches go in
        from pagedserve.benchmark.results import write_result
        config = {"model": model_dir, "device": args.device, "workload": args.workload,
                  "num_requests": len(requests), "rounds": args.rounds, "viewer": args.viewer,
                  "interval_s": args.interval, "serve_args": args.serve_args}
        write_result(args.output, "dashboard_overhead", "python " + " ".join(sys.argv), config, result, {},
                     {"throughput_drop_with_dashboard_open": round(result["drop"], 4),
                      "backlog_throughput_drop_with_dashboard_open": round(result["backlog_drop"], 4),
                      "viewer_hz_min": round(result["viewer_hz_min"], 2)},
                     device="cpu" if args.device == "cpu" else None)
    return 0


def toggle_main(args, proc, base, requests, viewer_cls, model_dir: str) -> int:
    try:
        one_round(base, requests[: max(8, len(requests) // 16)], None, args.interval)  # warm-up
        result = toggled_run(base, requests, viewer_cls, args.interval, args.toggle, args.client_processes,
                             args.max_concurrency)
    finally:
        stop_process(proc)
    trace = os.environ.get(STEP_TRACE_ENV, "").strip()
    if trace and Path(trace).exists():  # the server inherited it: the engine's own rate per segment
        steps = [json.loads(line) for line in Path(trace).read_text().splitlines() if line.strip()]
        engine_segment_rates(steps, result["segments"])
        engine = toggle_drop(result["segments"], "engine_decode_tok_s")
        batches = [s["engine_mean_seqs"] for s in result["segments"] if s["counted"]]
        result["engine"] = {**engine, "mean_seqs_median": statistics.median(batches) if batches else 0.0}
    if result["summary"]["failed"]:
        raise SystemExit(f"{result['summary']['failed']} requests failed ({result['summary']['errors']}), the "
                         f"first with {result['summary']['first_error']!r}: the comparison would be meaningless "
                         f"(server log: {args.server_log})")
    for seg in result["segments"]:
        print(("open  " if seg["open"] else "closed"), json.dumps(seg), flush=True)
    drop = result["paired_drop_median"]
    print(f"{len(result['paired_drops'])} open segments between closed ones: median drop "
          f"{'n/a' if drop is None else f'{100 * drop:.2f}%'}; medians open "
          f"{result['open_segment_tok_s_median']}, closed {result['closed_segment_tok_s_median']} tok/s; "
          f"viewer >= {result['viewer_hz_min_segments']} frames/s")
    engine = result.get("engine")
    if engine:
        drop_e = engine["paired_drop_median"]
        print(f"engine's step trace: median drop {'n/a' if drop_e is None else f'{100 * drop_e:.2f}%'}; medians "
              f"open {engine['open_segment_tok_s_median']}, closed {engine['closed_segment_tok_s_median']} "
              f"decode tok/s; median batch {engine['mean_seqs_median']:.1f} sequences")
    if args.output:
        from pagedserve.benchmark.results import write_result
        config = {"model": model_dir, "device": args.device, "workload": args.workload,
                  "num_requests": len(requests), "toggle_s": args.toggle, "viewer": args.viewer,
                  "interval_s": args.interval, "serve_args": args.serve_args,
                  "client_processes": args.client_processes, "max_concurrency": args.max_concurrency}
        ratios = {"paired_segment_drop_median": None if drop is None else round(drop, 4),
                  "open_segments_between_closed": len(result["paired_drops"])}
        if engine and engine["paired_drop_median"] is not None:
            ratios["engine_paired_segment_drop_median"] = round(engine["paired_drop_median"], 4)
        write_result(args.output, "dashboard_overhead_toggle", "python " + " ".join(sys.argv), config, result,
                     {}, ratios, device="cpu" if args.device == "cpu" else None)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--sse-viewer":
        sys.exit(_sse_viewer_main(sys.argv[2]))
    sys.exit(main())
