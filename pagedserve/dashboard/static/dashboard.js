// The KV page map. One cell per physical block, marked data-block (its id) and data-state
// (free | used | shared | cached, plus reserved for contiguous allocators). Live mode reads
// /kv_cache/events with fetch() so the API key travels in a header, never in a URL; sim mode
// drives a simulator replay with /sim/* calls. Plain JS, no dependencies.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "pagedserve-dashboard-key";
  const SERIES_MS = 5 * 60 * 1000;      // live charts: the last five minutes
  const SERIES_STEPS = 600;             // sim charts: the last 600 steps
  const MAX_TABLE_REQUESTS = 48;
  const MAX_TABLE_CELLS = 96;
  const CPU_SHOWN_MIN = 512;

  const S = {
    key: null, config: null, frame: null,
    states: [], cpuStates: {}, cpuOwned: {}, cells: [], cpuCells: [],
    owners: new Map(), cpuOwners: new Map(),
    series: [], lastTokens: null, playing: false, tables: new Map(),
  };

  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  const fmt = (n) => (n == null ? "–" : Number(n).toLocaleString("en-US"));
  const pct = (x) => (x == null ? "–" : (100 * x).toFixed(1) + "%");

  function loadKey() {
    const m = location.hash.match(/key=([^&]+)/);
    if (m) {
      sessionStorage.setItem(KEY_STORE, decodeURIComponent(m[1]));
      history.replaceState(null, "", location.pathname + location.search);  // keep it off screen
    }
    S.key = sessionStorage.getItem(KEY_STORE);
  }
  const authHeaders = () => (S.key ? { Authorization: "Bearer " + S.key } : {});

  function setStatus(status, text) {
    document.body.dataset.status = status;
    $("status").textContent = text || status;
  }

  // ---- the block map ------------------------------------------------------------------
  function buildGrid(el, n, attr) {
    el.textContent = "";
    const frag = document.createDocumentFragment();
    const cells = new Array(n);
    for (let i = 0; i < n; i++) {
      const c = document.createElement("i");
      c.className = "cell";
      c.dataset[attr] = i;
      c.dataset.state = "free";
      cells[i] = c;
      frag.appendChild(c);
    }
    el.appendChild(frag);
    el.classList.toggle("big", n <= 1024);
    el.classList.toggle("dense", n > 2048 && n <= 16384);
    el.classList.toggle("tiny", n > 16384);
    return cells;
  }

  // Frames carry one letter per block, spelled out by the frame's state_names (a full frame:
  // a string of them; a diff: [start, letters] per run of changed cells): 65,536 names cost
  // the server and this page milliseconds per frame, the letters a copy.
  function applyStates(full, changed, names) {
    if (full != null) {
      if (S.cells.length !== full.length) {
        S.cells = buildGrid($("gpu-map"), full.length, "block");
        S.states = [];
      }
      for (let i = 0; i < full.length; i++) {
        const s = names[full[i]];
        if (S.states[i] !== s) { S.states[i] = s; S.cells[i].dataset.state = s; }
      }
    } else if (changed) {
      for (const [start, run] of changed) {
        for (let k = 0; k < run.length; k++) {
          const s = names[run[k]];
          S.states[start + k] = s;
          S.cells[start + k].dataset.state = s;
        }
      }
    }
  }

  // The CPU pool is sparse (often far more blocks than the device): draw its first blocks,
  // enough to include every swapped-out one; the rest are free.
  function applyCpu(total, owned) {
    const ids = Object.keys(owned).map(Number);
    const top = ids.length ? Math.max(...ids) + 1 : 0;
    const shown = Math.min(total, Math.max(CPU_SHOWN_MIN, Math.ceil(top / 256) * 256));
    if (S.cpuCells.length !== shown) {
      S.cpuCells = buildGrid($("cpu-map"), shown, "cpuBlock");
      S.cpuOwned = {};
    }
    for (const i of Object.keys(S.cpuOwned)) if (!(i in owned)) S.cpuCells[i].dataset.state = "free";
    for (const [i, st] of Object.entries(owned)) S.cpuCells[i].dataset.state = st;
    S.cpuOwned = owned;
    S.cpuStates = owned;
    $("cpu-caption").textContent = total ? `${fmt(ids.length)} of ${fmt(total)} in use` +
      (shown < total ? ` (first ${fmt(shown)} drawn; the rest are free)` : "") : "";
  }

  function ownersOf(requests, where) {
    const owners = new Map();
    for (const r of requests) {
      for (const s of r.seqs) {
        if (s.where !== where) continue;
        s.block_table.forEach((b, i) => {
          if (!owners.has(b)) owners.set(b, []);
          owners.get(b).push([r.request_id, s.seq_id, i]);
        });
      }
    }
    return owners;
  }

  // Diff frames carry only what each block table grew by ('append'); rebuild the full tables.
  function rebuildTables(f) {
    const tables = new Map();
    for (const r of f.requests) {
      for (const s of r.seqs) {
        const key = s.where + ":" + s.seq_id;
        if (!s.block_table) s.block_table = (S.tables.get(key) || []).concat(s.append || []);
        tables.set(key, s.block_table);
      }
    }
    S.tables = tables;
  }

  // ---- one frame -------------------------------------------------------------------------
  function applyFrame(f) {
    rebuildTables(f);
    applyStates(f.states, f.states_changed, f.state_names);
    applyCpu(f.num_cpu_blocks, f.cpu_states);
    S.frame = f;
    S.owners = ownersOf(f.requests, "gpu");
    S.cpuOwners = ownersOf(f.requests, "cpu");
    document.body.dataset.version = f.version;
    document.body.dataset.numBlocks = f.num_blocks;
    $("allocator-name").textContent = f.allocator;
    $("map-caption").textContent = `${fmt(f.num_blocks)} blocks × ${f.block_size} tokens` +
      (f.snapshot_s != null ? ` · snapshot ${(1000 * f.snapshot_s).toFixed(1)} ms` : "");
    renderCounters(f);
    renderBars(f);
    renderTables(f);
    pushSeries(f);
    if (f.sim) renderSim(f.sim);
  }

  function setMetric(name, value, text) {
    const el = document.querySelector(`[data-metric="${name}"]`);
    el.dataset.value = value;
    el.textContent = text;
  }
  function setCounter(name, text, value) {
    const el = document.querySelector(`[data-counter="${name}"]`);
    el.textContent = text;
    if (value !== undefined) el.dataset.value = value;  // the unrounded figure, which the browser test compares
  }

  function renderCounters(f) {
    const st = f.stats;
    setCounter("blocks_used", fmt(st.num_blocks_used));
    setCounter("blocks_free", fmt(st.num_blocks_free - st.num_blocks_cached));
    setCounter("blocks_cached", fmt(st.num_blocks_cached));
    setCounter("live_tokens", fmt(st.num_live_tokens));
    setCounter("allocated_slots", fmt(st.num_allocated_slots));
    const unfilled = st.num_allocated_slots ? 1 - st.num_live_tokens / st.num_allocated_slots : 0;
    setCounter("internal_frag", pct(unfilled));
    setCounter("swap_outs", fmt(f.num_swap_outs));
    setCounter("swap_ins", fmt(f.num_swap_ins));
    setMetric("pagedserve:kv_cache_usage_perc", st.usage, pct(st.usage));
    setMetric("pagedserve:prefix_cache_hit_rate", st.prefix_cache_hit_rate, pct(st.prefix_cache_hit_rate));
    setMetric("pagedserve:num_preemptions_total", st.num_preemptions, fmt(st.num_preemptions));
    setMetric("pagedserve:num_requests_running", f.num_running, fmt(f.num_running));
    setMetric("pagedserve:num_requests_waiting", f.num_waiting, fmt(f.num_waiting));
    setMetric("pagedserve:num_requests_swapped", f.num_swapped, fmt(f.num_swapped));
    if (f.spec_decode) {  // only with speculative decoding on (engine get_kv_cache_state)
      for (const el of document.querySelectorAll(".spec-row")) el.hidden = false;
      const sd = f.spec_decode;
      setCounter("spec_acceptance", pct(sd.acceptance_rate), sd.acceptance_rate);
      setCounter("spec_mean_accepted", sd.mean_accepted_length.toFixed(2), sd.mean_accepted_length);
      setCounter("spec_proposer_s", sd.proposer_seconds.toFixed(2) + " s", sd.proposer_seconds);
    }
  }

  function renderBars(f) {
    const cap = f.num_blocks * f.block_size;
    let paged = 0;  // slots held by the running requests' tables (shared blocks once)
    const seen = new Set();
    for (const r of f.requests) {
      if (r.status !== "running") continue;
      for (const s of r.seqs) for (const b of s.block_table) if (!seen.has(b)) { seen.add(b); paged += f.block_size; }
    }
    $("bar-paged-label").textContent = `${f.allocator}, held now`;
    const need = f.contiguous_would_need;
    const rows = [["paged", paged], ["request", need.prompt_plus_max_tokens], ["max", need.max_model_len], ["cap", cap]];
    const top = Math.max(1, ...rows.map((r) => r[1]));
    for (const [id, v] of rows) {
      $("bar-" + id).style.width = (100 * v / top).toFixed(2) + "%";
      $("bar-" + id + "-val").textContent = fmt(v);
      $("bar-" + id + "-val").dataset.value = v;
    }
  }

  function renderTables(f) {
    const box = $("tables");
    const frag = document.createDocumentFragment();
    const reqs = f.requests.slice(0, MAX_TABLE_REQUESTS);
    for (const r of reqs) {
      const div = document.createElement("div");
      div.className = "req";
      div.dataset.request = r.request_id;
      const head = document.createElement("div");
      head.innerHTML = '<span class="rid"></span><span class="st"></span>';
      head.firstChild.textContent = r.request_id;
      head.lastChild.textContent = `${r.status} · prompt ${r.prompt_len} · max_tokens ${r.max_tokens}`;
      div.appendChild(head);
      for (const s of r.seqs) {
        const row = document.createElement("div");
        row.className = "seqrow";
        const sid = document.createElement("span");
        sid.className = "sid";
        sid.textContent = `seq ${s.seq_id}${s.where === "cpu" ? " (cpu)" : ""}`;
        row.appendChild(sid);
        const states = s.where === "cpu" ? S.cpuStates : S.states;
        for (const b of s.block_table.slice(0, MAX_TABLE_CELLS)) {
          const c = document.createElement("i");
          c.className = "cell";
          c.dataset.state = states[b] || "used";
          c.title = `${s.where} block ${b}`;
          row.appendChild(c);
        }
        if (s.block_table.length > MAX_TABLE_CELLS) {
          const more = document.createElement("span");
          more.className = "more";
          more.textContent = `+${s.block_table.length - MAX_TABLE_CELLS}`;
          row.appendChild(more);
        }
        const toks = document.createElement("span");
        toks.className = "more";
        toks.textContent = `${s.num_computed_tokens}/${s.num_tokens} tok`;
        row.appendChild(toks);
        div.appendChild(row);
      }
      frag.appendChild(div);
    }
    box.replaceChildren(frag);
    const hidden = f.requests.length - reqs.length;
    $("tables-caption").textContent = `${f.requests.length} requests with blocks` + (hidden > 0 ? ` (first ${reqs.length} shown)` : "");
  }

  // ---- time series ------------------------------------------------------------------------
  function pushSeries(f) {
    const sim = Boolean(f.sim);
    const t = sim ? f.sim.step : f.time * 1000;
    let tput = null;
    const tokens = f.metrics ? f.metrics.generation_tokens_total : null;
    if (tokens != null && S.lastTokens && tokens >= S.lastTokens.tokens && t > S.lastTokens.t) {
      tput = (tokens - S.lastTokens.tokens) / ((t - S.lastTokens.t) / 1000);
    }
    if (tokens != null) S.lastTokens = { tokens, t };
    if (S.series.length && t < S.series[S.series.length - 1].t) S.series = [];  // a new run
    S.series.push({ t, usage: f.stats.usage, batch: f.num_running_seqs, tput });
    const horizon = sim ? SERIES_STEPS : SERIES_MS;
    while (S.series.length && S.series[0].t < t - horizon) S.series.shift();
    drawChart("chart-usage", "usage", 1, t - horizon, t);
    drawChart("chart-batch", "batch", null, t - horizon, t);
    drawChart("chart-tput", "tput", null, t - horizon, t);
  }

  function drawChart(id, key, fixedMax, t0, t1) {
    const canvas = $(id);
    const ctx = canvas.getContext("2d");
    const w = canvas.width, h = canvas.height;
    ctx.clearRect(0, 0, w, h);
    const pts = S.series.filter((p) => p[key] != null);
    if (!pts.length) return;
    const max = fixedMax || Math.max(1e-9, ...pts.map((p) => p[key]));
    ctx.strokeStyle = "#2f7de1";
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    pts.forEach((p, i) => {
      const x = ((p.t - t0) / Math.max(1, t1 - t0)) * (w - 2) + 1;
      const y = h - 2 - (p[key] / max) * (h - 14);
      if (i) ctx.lineTo(x, y); else ctx.moveTo(x, y);
    });
    ctx.stroke();
    ctx.fillStyle = "#667085";
    ctx.font = "10px system-ui";
    const last = pts[pts.length - 1][key];
    ctx.fillText(`now ${key === "usage" ? pct(last) : fmt(Math.round(last))} · max ${key === "usage" ? "100%" : fmt(Math.round(max))}`, 4, 10);
  }

  // ---- hover ---------------------------------------------------------------------------------
  function hover(ev) {
    const tip = $("tooltip");
    const t = ev.target;
    const gpu = t.dataset.block !== undefined;
    const id = gpu ? t.dataset.block : t.dataset.cpuBlock;
    if (id === undefined || !t.closest(".map")) { tip.hidden = true; return; }
    const owners = (gpu ? S.owners : S.cpuOwners).get(Number(id)) || [];
    const lines = [`${gpu ? "device" : "CPU"} block ${id}: ${t.dataset.state}`];
    for (const [rid, sid, idx] of owners.slice(0, 12)) lines.push(`req ${rid} · seq ${sid} · logical block ${idx}`);
    if (owners.length > 12) lines.push(`… ${owners.length - 12} more`);
    tip.textContent = lines.join("\n");
    tip.hidden = false;
    tip.style.left = Math.min(ev.clientX + 12, innerWidth - 370) + "px";
    tip.style.top = ev.clientY + 14 + "px";
  }

  // ---- live mode ---------------------------------------------------------------------------
  async function readEvents(resp, onIdle) {
    const reader = resp.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      onIdle();
      buf += dec.decode(value, { stream: true });
      let k;
      while ((k = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, k);
        buf = buf.slice(k + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5)).join("\n");
        if (data) applyFrame(JSON.parse(data));
      }
    }
  }

  function askKey(message) {
    setStatus("auth", message);
    const form = $("key-form");
    form.hidden = false;
    form.onsubmit = (ev) => {
      ev.preventDefault();
      S.key = $("key-input").value;
      sessionStorage.setItem(KEY_STORE, S.key);
      form.hidden = true;
      streamLive();
    };
  }

  async function streamLive() {
    const interval = new URLSearchParams(location.search).get("interval");
    const url = "/kv_cache/events" + (interval ? "?interval=" + encodeURIComponent(interval) : "");
    const stallMs = 1000 * (Number(interval) || 0.4) * 4 + 4000;  // 0.4 s: the server's default (feed.py)
    let delay = 250;
    for (;;) {
      const ctrl = new AbortController();
      let watchdog = null;
      const alive = () => { clearTimeout(watchdog); watchdog = setTimeout(() => ctrl.abort(), stallMs); };
      try {
        alive();
        const resp = await fetch(url, { headers: authHeaders(), cache: "no-store", signal: ctrl.signal });
        if (resp.status === 401) { clearTimeout(watchdog); askKey(S.key ? "wrong API key" : "API key needed"); return; }
        if (!resp.ok) throw new Error("HTTP " + resp.status);
        setStatus("live", "connected");
        delay = 250;
        await readEvents(resp, alive);
      } catch (e) { /* the server went away or stalled: reconnect below */ }
      clearTimeout(watchdog);
      setStatus("reconnecting");
      await sleep(delay);
      delay = Math.min(2 * delay, 2000);
    }
  }

  // ---- sim mode ----------------------------------------------------------------------------
  function renderSim(sim) {
    $("sim-step").textContent = sim.step;
    $("sim-step").dataset.value = sim.step;
    $("sim-done").hidden = !sim.done;
    $("sim-allocator").value = sim.allocator;
    if (sim.done) setPlaying(false);
  }

  async function simCall(path) {
    const resp = await fetch(path, { method: "POST", cache: "no-store" });
    if (!resp.ok) { setStatus("reconnecting", "HTTP " + resp.status); return null; }
    setStatus("live", "replay");
    const frame = await resp.json();
    applyFrame(frame);
    return frame;
  }

  function setPlaying(on) {
    S.playing = on;
    $("sim-play").textContent = on ? "Pause" : "Play";
  }

  async function playLoop() {
    while (S.playing) {
      const speed = Number($("sim-speed").value);
      const started = performance.now();
      const frame = await simCall("/sim/step?n=1");
      if (!frame || frame.sim.done) { setPlaying(false); break; }
      await sleep(Math.max(0, 1000 / speed - (performance.now() - started)));
    }
  }

  async function startSim(cfg) {
    $("sim-controls").hidden = false;
    $("chart-tput-label").textContent = "Throughput (live server only)";
    const sel = $("sim-allocator");
    for (const a of cfg.allocators) sel.add(new Option(a, a));
    sel.value = cfg.allocator;
    sel.onchange = () => { setPlaying(false); S.series = []; simCall("/sim/reset?allocator=" + encodeURIComponent(sel.value)); };
    $("sim-step-btn").onclick = () => { setPlaying(false); simCall("/sim/step?n=1"); };
    $("sim-play").onclick = () => { const on = !S.playing; setPlaying(on); if (on) playLoop(); };
    $("sim-speed").oninput = () => { $("sim-speed-val").textContent = $("sim-speed").value; };
    await simCall("/sim/step?n=0");
  }

  async function main() {
    loadKey();
    document.addEventListener("mousemove", hover);
    for (;;) {
      try {
        const resp = await fetch("/dashboard/config", { cache: "no-store" });
        S.config = await resp.json();
        break;
      } catch (e) {
        setStatus("reconnecting");
        await sleep(1000);
      }
    }
    $("mode").textContent = S.config.mode === "sim" ? "simulator replay" : "live server";
    if (S.config.mode === "sim") startSim(S.config);
    else streamLive();
  }

  main();
})();
