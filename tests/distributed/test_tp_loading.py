"""Sharded loading: each rank reads, straight from the safetensors file, only its own slice of
every split parameter, each slice exactly once, and the ranks' slices together cover every
tensor. What is split follows Megatron: q/k/v, gate/up and fc1 by output rows, o/down/fc2 by
input columns, embeddings and LM head by vocab rows; norms, row-parallel biases, OPT's learned
positions and (with fewer KV heads than ranks) k/v are replicated, read whole by every rank."""
import itertools
import re
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

import pagedserve.models.loader as loader
from pagedserve.models.loader import get_model, load_hf_config
from pagedserve.models.registry import get_model_class

REPLICATED = re.compile(r"(norm|layernorm|layer_norm)\.(weight|bias)$|embed_positions|"
                        r"(o_proj|out_proj|down_proj|fc2)\.bias$|"
                        r"(mlp|block_sparse_moe)\.gate\.weight$|shared_expert_gate\.weight$")  # MoE routers


class RecordingSlice:
    """A safetensors slice that logs every read as a box of [start, stop) ranges per dim."""

    def __init__(self, name, inner, log):
        self.name, self.inner, self.log = name, inner, log

    def get_shape(self):
        return self.inner.get_shape()

    def get_dtype(self):
        return self.inner.get_dtype()

    def __getitem__(self, index):
        shape = self.inner.get_shape()
        index = index if isinstance(index, tuple) else (index,)
        box = []
        for d, size in enumerate(shape):
            s = index[d] if d < len(index) else slice(None)
            start, stop, step = s.indices(size)
            assert step == 1
            box.append((start, stop))
        self.log.append((self.name, tuple(box)))
        return self.inner[index]


def box_cells(box):
    return set(itertools.product(*(range(a, b) for a, b in box)))


def load_rank(monkeypatch, model_dir, rank, tp, expert_parallel=False):
    """Build rank `rank` of `tp` exactly as its process would, logging every read from the file."""
    log = []
    real = loader.iterate_safetensors

    def recording(d):
        for name, sl in real(d):
            yield name, RecordingSlice(name, sl, log)
    monkeypatch.setattr(loader, "iterate_safetensors", recording)
    get_model(load_hf_config(model_dir), model_dir=model_dir, device=torch.device("cpu"), dtype=torch.float32,
              tp_rank=rank, tp_size=tp, expert_parallel=expert_parallel)
    monkeypatch.undo()
    return log


@pytest.mark.parametrize("arch,overrides,kv_replicated", [
    ("llama", {}, False),
    ("qwen3", {"num_key_value_heads": 1}, True),
    ("qwen2", {}, False),
    ("phi3", {}, False),  # q/k/v and gate/up fused in the checkpoint: read part by part
    ("phi3", {"num_key_value_heads": 1}, True),  # ... and its k/v parts replicated
    ("opt", {}, False),
    ("qwen2_moe", {}, False),  # every expert's (and the shared expert's) intermediate dim split
    ("mixtral", {}, False),
])
def test_each_rank_reads_its_slices_once(tiny_model_dir, monkeypatch, arch, overrides, kv_replicated):
    from safetensors import safe_open
    model_dir = str(tiny_model_dir(arch, **overrides))
    tp = 2
    shapes = {}
    for path in loader.safetensors_files(model_dir):
        with safe_open(path, "pt") as f:
            shapes.update({n: tuple(f.get_slice(n).get_shape()) for n in f.keys()})
    logs = [load_rank(monkeypatch, model_dir, r, tp) for r in range(tp)]

    tied = getattr(load_hf_config(model_dir), "tie_word_embeddings", False)
    expected = {n for n in shapes if not (tied and n == "lm_head.weight")}
    model_class = get_model_class(load_hf_config(model_dir))
    splits = (model_class.checkpoint_row_splits(SimpleNamespace(config=load_hf_config(model_dir)))
              if hasattr(model_class, "checkpoint_row_splits") else {})
    reads = {n: next((len(p) for f, p in splits.items() if f".{f}." in n), 1) for n in expected}
    for rank, log in enumerate(logs):
        assert Counter(n for n, _ in log) == reads, f"rank {rank}: each tensor (each part of a fused one) read once"
    for name in expected:
        shape = shapes[name]
        numel = 1
        for s in shape:
            numel *= s
        cells = []
        for log in logs:
            parts = [box_cells(b) for n, b in log if n == name]
            assert sum(map(len, parts)) == len(set().union(*parts)), f"{name}: a rank's parts do not overlap"
            cells.append(set().union(*parts))
        assert set().union(*cells) == box_cells(tuple((0, s) for s in shape)), f"{name}: union covers the tensor"
        for part, rows in _row_segments(name, shape[0], splits):  # a fused tensor: each part on its own
            part_cells = [{c for c in rank_cells if rows[0] <= c[0] < rows[1]} for rank_cells in cells]
            part_numel = numel // shape[0] * (rows[1] - rows[0])
            replicated = bool(REPLICATED.search(part)) or (kv_replicated and re.search(r"\.(k|v)_proj\.", part))
            for rank, c in enumerate(part_cells):
                want = part_numel if replicated else part_numel // tp
                assert len(c) == want, f"{part}: rank {rank} read {len(c)} of {part_numel} elements"
            if not replicated:
                assert not (part_cells[0] & part_cells[1]), f"{part}: ranks' slices are disjoint"


def _row_segments(name: str, rows: int, splits: dict) -> list[tuple[str, tuple[int, int]]]:
    """(the part's unfused name, its rows) for each part of a fused checkpoint tensor; else the whole."""
    fused = next((f for f in splits if f".{f}." in name), None)
    if fused is None:
        return [(name, (0, rows))]
    out, start = [], 0
    for part, n in splits[fused]:
        out.append((name.replace(f".{fused}.", f".{part}."), (start, start + n)))
        start += n
    return out


def test_expert_parallel_rank_reads_only_its_experts(tiny_model_dir, monkeypatch):
    """Whole experts per rank: rank r reads experts r*E/2 .. whole and never touches the others'."""
    from safetensors import safe_open
    model_dir = str(tiny_model_dir("mixtral"))  # 4 experts
    shapes = {}
    for path in loader.safetensors_files(model_dir):
        with safe_open(path, "pt") as f:
            shapes.update({n: tuple(f.get_slice(n).get_shape()) for n in f.keys()})
    for rank in range(2):
        log = load_rank(monkeypatch, model_dir, rank, 2, expert_parallel=True)
        read = {}
        for name, box in log:
            m = re.search(r"experts\.(\d+)\.", name)
            if m:
                read.setdefault(int(m.group(1)), []).append(box)
        assert sorted(read) == [2 * rank, 2 * rank + 1]
        for name, box in ((n, b) for n, b in log if "experts." in n):
            assert box == tuple((0, size) for size in shapes[name]), f"{name}: read whole"
