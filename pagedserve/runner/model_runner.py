"""ModelRunner: executes one SchedulerOutput on the device.

Order inside execute(): cache ops first (swap out, then swap in, then copy-on-write),
then one forward pass over the flattened mixed batch (decodes and prefill chunks together),
then logits for the last token of every sequence that samples this step, in schedule order and
in the model's dtype (the sampler converts to float32 where its math needs it; the fused sampling
kernels read them as they are, which saves a copy of the [n, vocab] logits every step). The
runner never decides policy; it only carries out the plan.

On CUDA the forward replays graphs where it can: a decode-only step, or one whose prefill is short
(runner/decode_rows.py: one decode row per token), the decode graph of its size; another step with
prefill, with cudagraph_mode="full" the full graph of its token count (runner/full_graphs.py,
attention by the unified kernel), else with "piecewise" piecewise graphs with attention between
them; anything larger runs eagerly. Which of these the last step took is `last_graph_path` (one
of GRAPH_PATHS; the step trace records it). The graphs are captured at start-up, and released, by
runner/graph_capture.py.
"""
from __future__ import annotations

import logging
import os
import time

import torch
from torch import nn

from pagedserve.attention import gathered_prefill, gathered_prefill_plan
from pagedserve.attention.backend import Attention
from pagedserve.attention.kv_quant import resolve_kv_cache_dtype
from pagedserve.config import EngineConfig
from pagedserve.core.plan import SchedulerOutput
from pagedserve.distributed import TPGroup, get_tp_group
from pagedserve.layers.quant import get_quantization_config
from pagedserve.layers.rotary import RotaryEmbedding
from pagedserve.models.loader import get_max_model_len, get_model
from pagedserve.models.nano_batches import NanoStreams, check_nano_batches, forward_in_halves
from pagedserve.runner import graph_capture
from pagedserve.runner.batch import ModelInput, host_batch
from pagedserve.runner.cache_engine import CacheEngine, cache_block_bytes
from pagedserve.runner.cuda_graph import DecodeCUDAGraphs
from pagedserve.runner.decode_rows import as_decode_rows, short_prefill_graphs_enabled
from pagedserve.runner.full_graphs import FullCUDAGraphs
from pagedserve.runner.kv_sizing import calibrate_kv_scales_at_startup, device_seconds, profile_num_gpu_blocks
from pagedserve.runner.piecewise_graphs import PiecewiseCUDAGraphs
from pagedserve.runner.request_state import DeviceRequestState
from pagedserve.runner.row_tracker import RowTracker, incremental_inputs_enabled
from pagedserve.runner.step_input import StepInput
from pagedserve.runner.warmup import warm_up, warmup_enabled

logger = logging.getLogger(__name__)
# How a step's forward ran (ModelRunner.last_graph_path): the decode graph of its size, the same
# graph over decode rows (a short prefill), the full graph of its token count (any mix), piecewise
# graphs with eager attention, eagerly, or eagerly as two nano-batches (models/nano_batches.py).
GRAPH_PATHS = ("decode_graph", "decode_rows", "full_graph", "piecewise", "eager", "nano_batches")
GiB = 1 << 30
# "1": a CPU runner also runs the profile phase (the same forward as on CUDA, timed; the pool is
# still sized from cpu_kv_cache_gib), so CPU runs take the GPU's start-up path and measure costs.
PROFILE_ON_CPU_ENV = "PAGEDSERVE_PROFILE_ON_CPU"
def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """"auto": the current CUDA device when there is one, else CPU."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {device!r}")
    return dev


class ModelRunner:
    def __init__(self, engine_config: EngineConfig, hf_config, device: torch.device, dtype: torch.dtype):
        self.config, self.hf_config = engine_config, hf_config
        self.device, self.dtype = torch.device(device), dtype
        # The KV pools' element type (fp8: e4m3 with per-layer scales) and the linear layers'
        # quantization: both checked against the device here, before anything is allocated.
        self.kv_dtype = resolve_kv_cache_dtype(engine_config.kv_cache_dtype, dtype, self.device)
        self.quant_config = get_quantization_config(engine_config.quantization, hf_config)
        self.block_size = engine_config.block_size
        # A single-rank engine stays single-rank even beside a tensor-parallel one in this process.
        tp = get_tp_group() if engine_config.tensor_parallel_size > 1 else TPGroup()
        if engine_config.tensor_parallel_size != tp.size:
            raise ValueError(f"tensor_parallel_size={engine_config.tensor_parallel_size} but this process's TP group "
                             f"has size {tp.size}: start the TP workers (pagedserve.distributed.init_tp_group) first")
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.model: nn.Module | None = None
        self.cache_engine: CacheEngine | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.max_model_len = engine_config.max_model_len or get_max_model_len(hf_config,
                                                                              engine_config.disable_sliding_window)
        self.profile: dict[str, float] = {}
        self.graphs: DecodeCUDAGraphs | None = None
        self.piecewise: PiecewiseCUDAGraphs | None = None
        self.full_graphs: FullCUDAGraphs | None = None
        # Persistent per-request state: the host rows (rank 0, prepare_inputs) and the device tensors
        # (every rank, execute_model), both made on first use. The engine turns the scheduler's table
        # log on when this is true.
        self.incremental_inputs = incremental_inputs_enabled()
        self.short_prefill_graphs = short_prefill_graphs_enabled()
        self.row_tracker: RowTracker | None = None
        self.request_state: DeviceRequestState | None = None
        self.last_graph_path: str | None = None  # how the last step's forward ran; None: it had none
        self.last_prompt_logits: torch.Tensor | None = None  # the last step's prompt_rows logits
        self.nano_streams = NanoStreams.for_engine(engine_config, self.device)  # eager nano-batched steps'

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    # --- model ---
    def load_model(self) -> nn.Module:
        fmt = self.config.load_format
        self.model = get_model(self.hf_config, model_dir=self.config.model, device=self.device, dtype=self.dtype,
                               load_format=fmt, seed=self.config.seed, tp_rank=self.tp_rank, tp_size=self.tp_size,
                               expert_parallel=self.config.enable_expert_parallel, quant_config=self.quant_config,
                               max_model_len=self.max_model_len)
        check_nano_batches(self.config, self.model, self.tp_size, self.device)
        attn = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.num_layers = len(attn)
        self.num_kv_heads, self.head_dim = attn[0].num_kv_heads, attn[0].head_dim
        # PAGEDSERVE_LONG_PREFILL: before the KV pool is sized, so that the profile counts its buffers;
        # where it is on, the engine's long-prompt chunk rules follow its prefix bucket. Off (length 0)
        # when every layer has a sliding window: none would take the path, nor cost more at length.
        full_layers = any(m.sliding_window == 0 for m in attn)
        if not full_layers and len({m.sliding_window for m in attn}) == 1:
            # One window for every layer: the KV manager can free the blocks before it (CacheConfig).
            self.profile["sliding_window_all_layers"] = attn[0].sliding_window
        if gathered_prefill.configure(self.device, self.max_model_len if full_layers else 0, self.num_kv_heads,
                                      self.head_dim, self.kv_dtype) is not None:
            self.profile["long_prefill_bucket"] = gathered_prefill_plan.PREFIX_BUCKET
        return self.model

    def fit_max_model_len(self, max_model_len: int) -> None:
        """max_model_len auto, fitted to the KV cache before any graph is captured: the RoPE that
        depends on the length (LongRoPE's factors) follows the fitted one. The runner's own bounds
        stay those of the model's limit it was built for, which cover it."""
        self._require("model")
        for m in self.model.modules():
            if isinstance(m, RotaryEmbedding):
                m.fit_max_positions(max_model_len)

    def _require(self, what: str):
        if what == "model" and self.model is None:
            raise RuntimeError("call load_model() first")
        if what == "cache" and self.cache_engine is None:
            raise RuntimeError("call init_kv_cache() first")

    # --- KV cache sizing ---
    @property
    def block_bytes(self) -> int:
        self._require("model")
        return cache_block_bytes(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.kv_dtype)

    @property
    def measures_costs(self) -> bool:
        """Whether start-up runs the profile and the swap measurement: always on CUDA; on CPU only
        with PAGEDSERVE_PROFILE_ON_CPU=1 (otherwise the scheduler keeps SchedulerConfig's constant
        recompute_seconds_per_token / swap_seconds_per_block)."""
        return self.device.type == "cuda" or os.environ.get(PROFILE_ON_CPU_ENV, "") == "1"

    def determine_num_blocks(self) -> tuple[int, int]:
        """(num_gpu_blocks, num_cpu_blocks): override, else profiled (CUDA) or cpu_kv_cache_gib (CPU).

        The profile runs whenever measures_costs, override or not: it measures
        recompute_seconds_per_token, and under tensor parallelism every rank must run its forward
        (and so its collectives) alike."""
        self._require("model")
        cfg = self.config
        if cfg.calculate_kv_scales:
            calibrate_kv_scales_at_startup(self)
        profiled = profile_num_gpu_blocks(self) if self.measures_costs else None
        if cfg.num_gpu_blocks_override is not None:
            num_gpu = cfg.num_gpu_blocks_override
        elif profiled is not None:
            num_gpu = profiled
        else:
            num_gpu = self._cpu_pool_blocks()
        if num_gpu < 1:
            raise ValueError(f"no room for KV cache blocks ({self.block_bytes} bytes each): raise "
                             "gpu_memory_utilization / cpu_kv_cache_gib or use a smaller model (or a smaller "
                             "speculative_config.model: a draft model's weights are loaded first)")
        num_cpu = int(cfg.swap_space * GiB // self.block_bytes)
        return num_gpu, num_cpu

    def _cpu_pool_blocks(self) -> int:
        return int(self.config.cpu_kv_cache_gib * GiB // self.block_bytes)

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """The start-up phases after sizing, in order (a tensor-parallel executor runs them one
        command at a time, every rank finishing each before the next; it skips the piecewise one)."""
        self.allocate_kv_cache(num_gpu_blocks, num_cpu_blocks)
        self.measure_swap_cost()
        # Each phase's seconds in profile (start-up time, beside warmup_seconds).
        for name, phase in (("decode_graphs", self.capture_decode_graphs), ("full_graphs", self.capture_full_graphs),
                            ("piecewise_graphs", self.capture_piecewise_graphs)):
            t0 = time.perf_counter()
            phase()
            self.profile[f"{name}_seconds"] = time.perf_counter() - t0
        self.warm_up()
        logger.info("start-up phases (s): %s", ", ".join(f"{k.removesuffix('_seconds')} {v:.1f}"
                                                         for k, v in self.profile.items() if k.endswith("_seconds")))

    def allocate_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self._require("model")
        self.cache_engine = CacheEngine(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size,
                                        num_gpu_blocks, num_cpu_blocks, self.kv_dtype, self.device)
        self.kv_caches = self.cache_engine.kv_caches

    def measure_swap_cost(self) -> None:
        """Seconds to move one block out to the CPU pool and back: preemption_mode="auto" weighs
        this against recompute_seconds_per_token. The pools are still empty, so nothing is lost."""
        self._require("cache")
        ce = self.cache_engine
        n = min(32, ce.num_gpu_blocks, ce.num_cpu_blocks)
        if not self.measures_costs or n < 1:
            return
        pairs = [(i, i) for i in range(n)]

        def round_trip():
            ce.swap_out(pairs)
            ce.swap_in(pairs)
        round_trip()
        self.profile["swap_seconds_per_block"] = device_seconds(self.device, round_trip) / n

    def capture_decode_graphs(self) -> None:
        """One CUDA graph per decode batch-size bucket (runner/graph_capture.py)."""
        graph_capture.capture_decode_graphs(self)

    def warm_up(self) -> None:
        """Run every kernel variant serving can meet once, leaving the pools as they were
        (pagedserve.runner.warmup; on CUDA, or wherever PAGEDSERVE_WARMUP=1)."""
        self._require("cache")
        if warmup_enabled(self.device):
            self.profile["warmup_seconds"] = warm_up(self)

    def release_cuda_graphs(self, synchronize: bool = True) -> int:
        """Destroy every captured CUDA graph now; returns how many (graph_capture.release_cuda_graphs
        says why tensor parallelism needs this before its NCCL groups go)."""
        return graph_capture.release_cuda_graphs(self, synchronize)

    def capture_piecewise_graphs(self) -> None:
        """Piecewise graphs for steps with prefill tokens (runner/graph_capture.py)."""
        graph_capture.capture_piecewise_graphs(self)

    def capture_full_graphs(self, graph_factory=None) -> None:
        """Full graphs for steps with prefill tokens (runner/graph_capture.py; graph_factory: a CPU
        stand-in for tests)."""
        graph_capture.capture_full_graphs(self, graph_factory)

    # --- one step ---
    @torch.inference_mode()
    def _forward(self, inp: ModelInput, kv_caches) -> torch.Tensor:
        hidden = self.model(inp.input_ids, inp.positions, kv_caches, inp.attn_meta)
        return self.model.compute_logits(hidden[inp.sample_indices])

    def _forward_with_prompt_logits(self, inp: ModelInput, prompt_rows) -> torch.Tensor | None:
        """An eager forward that also keeps the logits of prompt_rows in last_prompt_logits (rank 0's
        are the engine's prompt_logprobs; every rank computes them, as compute_logits gathers)."""
        self.last_graph_path = "eager"
        hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.attn_meta)
        rows = torch.from_numpy(prompt_rows).to(self.device, non_blocking=True)
        self.last_prompt_logits = self.model.compute_logits(hidden[rows])
        return self.model.compute_logits(hidden[inp.sample_indices]) if inp.num_sampling else None

    def prepare_inputs(self, out: SchedulerOutput) -> StepInput:
        """The host-side half of a step: no device work, nothing rank-specific."""
        batch = host_batch(out.scheduled, out.num_decodes) if out.scheduled else None
        if out.table_changes is None or not self.incremental_inputs:
            return StepInput(out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy, batch)
        if self.row_tracker is None:
            sched = self.config.scheduler_config(self.max_model_len)
            self.row_tracker = RowTracker(sched.max_num_seqs, -(-self.max_model_len // self.block_size))
        if batch is not None and batch.num_decodes < len(batch.starts):  # before the tables leave the batch
            batch.page_runs = gathered_prefill_plan.page_runs(batch.block_tables, batch.query_lens.tolist(),
                                                              (batch.starts + batch.query_lens).tolist(),
                                                              batch.num_decodes, self.block_size)
        rows = self.row_tracker.step_inputs(out, batch)
        return StepInput(out.blocks_to_swap_out, out.blocks_to_swap_in, out.blocks_to_copy, batch, rows)

    def reset_request_state(self) -> None:
        """Forget every row (host and device): for a fresh scheduler, whose table log starts empty."""
        self.row_tracker = None
        self.request_state = None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, prev_sampled: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run the plan; logits [num_sampling, vocab] (model dtype) in the order of out.scheduled
        filtered by do_sample, or None when no sequence samples this step. prev_sampled: the
        previous step's sampled token ids on the device, the source of this step's placeholder
        tokens (if any)."""
        return self.execute_model(self.prepare_inputs(out), prev_sampled)

    @torch.inference_mode()
    def execute_model(self, step: StepInput, prev_sampled: torch.Tensor | None = None) -> torch.Tensor | None:
        """The device-side half: cache ops, then the forward over this rank's heads."""
        self._require("model")
        self._require("cache")
        ce = self.cache_engine
        self.last_graph_path = None
        self.last_prompt_logits = None
        if step.blocks_to_swap_out:
            ce.swap_out(step.blocks_to_swap_out)
        if step.blocks_to_swap_in:
            ce.swap_in(step.blocks_to_swap_in)
        if step.blocks_to_copy:
            ce.copy(step.blocks_to_copy)
        if step.rows is not None:
            if self.request_state is None:
                self.request_state = DeviceRequestState(step.rows.num_rows, step.rows.num_cols, self.device)
            inp = self.request_state.prepare(step.rows, step.batch, self.block_size)
            if inp is None:
                return None
        elif step.batch is None:
            return None
        else:
            inp = step.batch.to_model_input(self.block_size, self.device)
        inp.fill_placeholders(prev_sampled)
        n = len(step.batch.query_lens)
        if step.batch.prompt_rows is not None:
            return self._forward_with_prompt_logits(inp, step.batch.prompt_rows)
        if self.graphs is not None and step.batch.num_decodes == n and self.graphs.bucket_for(n) is not None:
            self.last_graph_path = "decode_graph"
            hidden = self.graphs.run(inp.input_ids, inp.positions, inp.attn_meta)
            return self.model.compute_logits(hidden[inp.sample_indices])
        num_tokens = len(step.batch.input_ids)
        if (self.graphs is not None and self.short_prefill_graphs and step.batch.num_decodes < n
                and self.graphs.bucket_for(num_tokens) is not None):
            rows = as_decode_rows(inp.attn_meta, inp.positions)  # runner/decode_rows.py
            if rows is not None:
                self.last_graph_path = "decode_rows"
                hidden = self.graphs.run(inp.input_ids, inp.positions, rows)
                if inp.num_sampling == 0:
                    return None
                return self.model.compute_logits(hidden[inp.sample_indices])
        # Any mix: also a decode-only step that no decode graph took (a batch above their sizes).
        if self.full_graphs is not None and self.full_graphs.takes(num_tokens, n, inp.attn_meta):
            self.last_graph_path = "full_graph"
            hidden = self.full_graphs.run(inp.input_ids, inp.positions, inp.attn_meta)
            if inp.num_sampling == 0:
                return None
            return self.model.compute_logits(hidden[inp.sample_indices])
        if (self.piecewise is not None and step.batch.num_decodes < n
                and self.piecewise.bucket_for(num_tokens) is not None):
            self.last_graph_path = "piecewise"
            hidden = self.piecewise.run(inp.input_ids, inp.positions, inp.attn_meta)
            if inp.num_sampling == 0:
                return None
            return self.model.compute_logits(hidden[inp.sample_indices])
        rows = self.config.nano_batch_rows
        if rows and step.batch.num_decodes == n >= rows:
            self.last_graph_path = "nano_batches"
            hidden = forward_in_halves(self.model, inp.input_ids, inp.positions, self.kv_caches, inp.attn_meta,
                                       self.nano_streams, self.config.nano_batch_sm_carveout)
            return self.model.compute_logits(hidden[inp.sample_indices])
        self.last_graph_path = "eager"
        if inp.num_sampling == 0:
            # Still run the forward: it writes this chunk's K/V into the cache.
            self.model(inp.input_ids, inp.positions, self.kv_caches, inp.attn_meta)
            return None
        return self._forward(inp, self.kv_caches)
