"""DeviceRequestState: per-request state that stays on the device between steps.

Each sequence with a device block table owns one row (assigned on the host by row_tracker.py):
  block_table [rows, cols] int32   its physical block ids, zero past its length
  computed    [rows] int64         tokens with KV computed after the last step that ran it
A step uploads only what changed (rows freed, table entries written, the rows it runs on, its
new tokens) in one copy from one pinned staging buffer, then applies it with a few index ops:
no per-request copies, no kernels of our own. What a step needs beyond that is derived here:
  - every step: the attention block tables (a gather of the step's rows) and the slot of each
    token (block_table[row, position // block_size]), so no block table is built on the host;
  - decode-only steps: positions = computed[row], seq_lens = positions + 1, query_start_loc
    = arange, so such a step uploads a row index and a token per sequence and nothing else
    (plus the rows the tracker has to correct, and any new block ids).
After every step computed[row] = seq_len, on the device, as the host mirror does.

Correctness on CUDA by construction: everything is queued on the current stream in step order,
so a row freed and reused in step N+1 is rewritten only after step N (which gathered its own copy
of its rows' tables) has read it; the staging buffer is fresh pinned memory from the caching host
allocator, which does not reuse it until the copy from it is done. The tensors may be reallocated
when they grow: CUDA graphs never read them directly, only the per-step gathers copied into the
graphs' own static buffers (cuda_graph.py, piecewise_graphs.py).
"""
from __future__ import annotations

import numpy as np
import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.runner.batch import HostBatch, ModelInput, _to_device, sample_rows
from pagedserve.runner.row_tracker import RowInputs


class DeviceRequestState:
    def __init__(self, num_rows: int, num_cols: int, device: torch.device):
        self.device = torch.device(device)
        self.block_table = torch.zeros(num_rows, num_cols, dtype=torch.int32, device=self.device)
        self.computed = torch.zeros(num_rows, dtype=torch.int64, device=self.device)
        # Instrumentation: bytes of each array in the last step's upload, and the running total.
        self.last_upload: dict[str, int] = {}
        self.bytes_uploaded = 0

    def _grow(self, rows: int, cols: int) -> None:
        r, c = self.block_table.shape
        if rows <= r and cols <= c:
            return
        table = torch.zeros(max(rows, r), max(cols, c), dtype=torch.int32, device=self.device)
        table[:r, :c] = self.block_table
        computed = torch.zeros(max(rows, r), dtype=torch.int64, device=self.device)
        computed[:r] = self.computed
        self.block_table, self.computed = table, computed

    def _upload(self, named: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        named = {k: v for k, v in named.items() if v is not None and v.size}
        self.last_upload = {k: int(v.nbytes) for k, v in named.items()}
        self.bytes_uploaded += sum(self.last_upload.values())
        if not named:
            return {}
        return dict(zip(named, _to_device(list(named.values()), self.device)))

    def prepare(self, rows: RowInputs, batch: HostBatch | None, block_size: int) -> ModelInput | None:
        """Apply the step's changes; the step's ModelInput, or None when nothing runs (batch None)."""
        self._grow(rows.num_rows, rows.num_cols)
        decode_only = batch is not None and batch.num_decodes == len(rows.rows)
        arrays: dict[str, np.ndarray | None] = {
            "cleared_rows": rows.cleared_rows, "entry_rows": rows.entry_rows, "entry_cols": rows.entry_cols,
            "entry_vals": rows.entry_vals, "start_rows": rows.start_rows, "start_vals": rows.start_vals,
        }
        host = None
        if batch is not None:
            host = _host_side(batch, rows.rows, rows.table_lens, block_size, decode_only)
            arrays.update(rows=rows.rows, input_ids=batch.input_ids, placeholder_dst=batch.placeholder_dst,
                          placeholder_src=batch.placeholder_src)
            if not decode_only:
                arrays.update(positions=host["positions"], token_rows=host["token_rows"], cu=host["cu"],
                              seq_lens=host["seq_lens"])
            if not batch.sample_mask.all() or batch.logit_counts is not None:
                arrays["sample_indices"] = host["sample_indices"]
        dev = self._upload(arrays)
        if "cleared_rows" in dev:
            self.block_table.index_fill_(0, dev["cleared_rows"], 0)
        if "entry_rows" in dev:
            self.block_table.index_put_((dev["entry_rows"], dev["entry_cols"]), dev["entry_vals"])
        if "start_rows" in dev:
            self.computed.index_copy_(0, dev["start_rows"], dev["start_vals"])
        if batch is None:
            return None
        return self._model_input(dev, host, batch, decode_only, block_size)

    def _model_input(self, dev: dict, host: dict, batch: HostBatch, decode_only: bool, block_size: int) -> ModelInput:
        rows_t = dev["rows"]
        n = rows_t.shape[0]
        if decode_only:
            positions = self.computed.index_select(0, rows_t)
            seq_lens = positions + 1
            self.computed.index_copy_(0, rows_t, seq_lens)
            seq_lens = seq_lens.to(torch.int32)
            token_rows = rows_t
            cu = torch.arange(n + 1, dtype=torch.int32, device=self.device)
        else:
            positions, token_rows, cu, seq_lens = dev["positions"], dev["token_rows"], dev["cu"], dev["seq_lens"]
            self.computed.index_copy_(0, rows_t, seq_lens.to(torch.int64))
        blocks = self.block_table[token_rows, torch.div(positions, block_size, rounding_mode="floor")]
        slots = blocks.to(torch.int64) * block_size + positions % block_size
        width = host["width"]
        tables = self.block_table[:, :width].index_select(0, rows_t)
        num_sampling = host["num_sampling"]
        if "sample_indices" in dev:  # some rows do not sample, or speculative rows return several
            sample = dev["sample_indices"]
        elif num_sampling == n:  # every sequence samples: its last token's row
            sample = (torch.arange(n, dtype=torch.int64, device=self.device) if decode_only
                      else cu[1:].to(torch.int64) - 1)
        else:  # none samples (an empty array does not travel)
            sample = torch.zeros(0, dtype=torch.int64, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=cu, seq_lens=seq_lens, block_tables=tables,
            num_decodes=batch.num_decodes, max_query_len=host["max_query_len"], max_seq_len=host["max_seq_len"],
            block_size=block_size, query_lens_cpu=host["query_lens"], seq_lens_cpu=host["seq_lens_list"],
            page_runs=batch.page_runs)
        return ModelInput(input_ids=dev["input_ids"], positions=positions, attn_meta=meta, sample_indices=sample,
                          num_sampling=num_sampling, placeholder_dst=dev.get("placeholder_dst"),
                          placeholder_src=dev.get("placeholder_src"))


def _host_side(batch: HostBatch, rows: np.ndarray, table_lens: np.ndarray, block_size: int,
               decode_only: bool) -> dict:
    """What the host computes for the step: the metadata's host copies and, unless every sequence
    decodes, the per-token arrays (positions, each token's row in the state) that get uploaded."""
    n = len(batch.starts)
    starts, query_lens = batch.starts, batch.query_lens
    seq_lens = starts + query_lens
    short = np.nonzero(table_lens * block_size < seq_lens)[0]
    if short.size:
        i = int(short[0])
        raise ValueError(f"block table of scheduled sequence {i} has {table_lens[i]} blocks of {block_size}, "
                         f"too few for {seq_lens[i]} tokens")
    out = {"width": int(table_lens.max(initial=1)), "seq_lens_list": seq_lens.tolist(),
           "max_seq_len": int(seq_lens.max(initial=0)), "num_sampling": int(batch.sample_mask.sum())}
    if decode_only:
        out.update(query_lens=[1] * n, max_query_len=1 if n else 0)
        if out["num_sampling"] not in (0, n):  # otherwise derived on the device, nothing to send
            out["sample_indices"] = np.nonzero(batch.sample_mask)[0].astype(np.int64)
        return out
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu[1:])
    ql = query_lens.tolist()
    out.update(query_lens=ql, max_query_len=int(max(ql, default=0)), cu=cu.astype(np.int32),
               seq_lens=seq_lens.astype(np.int32),
               positions=np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1] - starts, query_lens),
               token_rows=np.repeat(rows, query_lens), sample_indices=sample_rows(cu, batch.sample_mask, batch.logit_counts))
    out["num_sampling"] = int(out["sample_indices"].shape[0])
    return out
