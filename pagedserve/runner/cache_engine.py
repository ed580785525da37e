"""The KV pools: one device pool and one (pinned, on CUDA) CPU pool, and the swap / copy plans on them.

Each pool is a single tensor [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim];
layer l's K pool is pool[l, 0], a contiguous [num_blocks, block_size, num_kv_heads, head_dim] view.
Keeping every layer in one tensor lets a swap move a set of blocks for all layers with one
gather, one transfer and one scatter, instead of a Python loop over layers x blocks.

An fp8 (e4m3) cache is stored as uint8 and handed to the kernels as float8_e4m3fn views: swaps
and copies move bytes (torch has no index_copy_ for fp8), and a block needs nothing but its bytes,
since its scales are per layer (attention/kv_quant.py), so a round trip is bit-exact.
"""
from __future__ import annotations

import torch

from pagedserve.attention.backend import get_backend
from pagedserve.attention.kv_quant import is_fp8

# Bound on the host staging buffer used by one swap transfer (bigger plans go in chunks).
SWAP_CHUNK_BYTES = 256 * 1024 * 1024


def cache_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype) -> int:
    """Bytes one block costs across all layers, K and V."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * elem


class CacheEngine:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, num_gpu_blocks: int,
                 num_cpu_blocks: int, dtype: torch.dtype, device: torch.device):
        self.num_layers, self.block_size = num_layers, block_size
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
        self.device, self.dtype = torch.device(device), dtype
        self.storage_dtype = torch.uint8 if is_fp8(dtype) else dtype
        self.block_shape = (block_size, num_kv_heads, head_dim)
        store = self.storage_dtype
        self.gpu_pool = torch.zeros(num_layers, 2, num_gpu_blocks, *self.block_shape, dtype=store, device=self.device)
        pin = self.device.type == "cuda"
        self.cpu_pool = torch.empty(num_layers, 2, num_cpu_blocks, *self.block_shape, dtype=store, pin_memory=pin)
        self.block_bytes = cache_block_bytes(num_layers, block_size, num_kv_heads, head_dim, dtype)
        self._chunk_blocks = max(1, SWAP_CHUNK_BYTES // self.block_bytes)
        self._staging = None
        if pin and num_cpu_blocks:
            n = min(self._chunk_blocks, num_cpu_blocks)
            self._staging = torch.empty(n * self.block_bytes // self.gpu_pool.element_size(), dtype=store,
                                        pin_memory=True)

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k_cache, v_cache), each [num_gpu_blocks, block_size, num_kv_heads, head_dim]."""
        pool = self.gpu_pool.view(self.dtype) if self.storage_dtype != self.dtype else self.gpu_pool
        return [(pool[l, 0], pool[l, 1]) for l in range(self.num_layers)]

    def _host_buffer(self, n: int) -> torch.Tensor:
        shape = (self.num_layers, 2, n, *self.block_shape)
        if self._staging is None:
            return torch.empty(shape, dtype=self.storage_dtype)
        return self._staging[: self.gpu_pool[:, :, :n].numel()].view(shape)

    def _chunks(self, pairs: list[tuple[int, int]]):
        for i in range(0, len(pairs), self._chunk_blocks):
            chunk = pairs[i:i + self._chunk_blocks]
            yield (torch.tensor([p[0] for p in chunk], dtype=torch.long),
                   torch.tensor([p[1] for p in chunk], dtype=torch.long))

    def _check(self, ids: torch.Tensor, limit: int, what: str) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= limit):
            raise IndexError(f"{what} block id out of range [0, {limit}): {ids.tolist()}")

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, cpu block) pairs: device -> CPU, all layers, K and V."""
        for src, dst in self._chunks(pairs):
            self._check(src, self.num_gpu_blocks, "device")
            self._check(dst, self.num_cpu_blocks, "cpu")
            gathered = self.gpu_pool.index_select(2, src.to(self.device, non_blocking=True))
            host = self._host_buffer(len(src))
            host.copy_(gathered, non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            self.cpu_pool.index_copy_(2, dst, host)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(cpu block, device block) pairs: CPU -> device, all layers, K and V."""
        for src, dst in self._chunks(pairs):
            self._check(src, self.num_cpu_blocks, "cpu")
            self._check(dst, self.num_gpu_blocks, "device")
            host = self._host_buffer(len(src))
            torch.index_select(self.cpu_pool, 2, src, out=host)
            self.gpu_pool.index_copy_(2, dst.to(self.device, non_blocking=True),
                                      host.to(self.device, non_blocking=True))
            if self.device.type == "cuda":
                # The staging buffer is reused by the next chunk: wait for this transfer.
                torch.cuda.current_stream(self.device).synchronize()

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write (src, dst) device blocks, through the attention backend's kernel."""
        if not pairs:
            return
        caches = self.kv_caches
        get_backend(self.device).copy_blocks([k for k, _ in caches], [v for _, v in caches], pairs)
