"""One-shot all-reduce through torch symmetric memory, for decode-sized messages (opt-in).

Why: on 2xH200 with NVLink SHARP off, NCCL runs the 2 MB all-reduce of a 256-sequence
Llama-3.1-8B decode step with its LL ring protocol at ~50 us a call; 65 calls a step took 3.3 ms
of a ~9 ms TP=2 step (benchmarks/results/h200x2/profile_decode_tp2.json at 085864a). torch's
one-shot kernel copies each rank's part into a buffer every rank can address, meets the others at
a barrier, and has every rank read and sum all parts itself; a second barrier at its end lets the
next call reuse the buffer. One kernel, no ring: the shape of vLLM's custom all-reduce for small
messages. It reads the peers' buffers directly (NVLink P2P), not through multicast, so it works
with NVLS off.

Opt-in (PAGEDSERVE_TP_ALLREDUCE=symm_mem). Measured at 3517b5d on 2xH200 (Llama-3.1-8B fixed256,
TP=2): it agreed with TP=1 as NCCL does but ran 128.3 req/s against NCCL's 132.0
(benchmarks/results/h200x2/logs/3517b5d/), so NCCL stays the default. Only contiguous
bfloat16/float32 tensors up to PAGEDSERVE_TP_ALLREDUCE_MAX_MB (default 8: a 1024-token step of a
4096-wide model in bf16) take it; prefill-sized ones and everything else stay on NCCL. Every rank
sets it up and checks one reduction against the sum it knows; it is used only if all ranks
succeeded (a MIN over the compute group), so the ranks never disagree about which collective
runs next.
"""
from __future__ import annotations

import logging
import os

import torch

from pagedserve.runner.dist_env import env_positive

logger = logging.getLogger(__name__)

SWITCH = "PAGEDSERVE_TP_ALLREDUCE"
MAX_MB = "PAGEDSERVE_TP_ALLREDUCE_MAX_MB"
CHOICES = ("nccl", "symm_mem")
_DTYPES = (torch.bfloat16, torch.float32)
_ALIGN = 16  # bytes: the kernel's widest vector; pointer and size must share it with the buffer's


def requested() -> str:
    """The all-reduce the environment asks for; ValueError names the variable and its values."""
    value = os.environ.get(SWITCH, "nccl").strip().lower() or "nccl"
    if value not in CHOICES:
        raise ValueError(f"{SWITCH} must be one of {', '.join(CHOICES)}, got {value!r}")
    return value


def max_bytes() -> int:
    return int(env_positive(MAX_MB, 8.0, "MiB") * 2**20) // _ALIGN * _ALIGN


class SymmMemAllReduce:
    """A symmetric buffer of max_bytes on this rank's device, registered with the group."""

    def __init__(self, group, device: torch.device, dtype: torch.dtype, nbytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch, a no-op later
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.dtype = dtype
        self.buffer = symm_mem.empty(nbytes // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        self._op = torch.ops.symm_mem.one_shot_all_reduce_copy_out

    def fits(self, x: torch.Tensor) -> bool:
        n = x.numel() * x.element_size()
        return (x.dtype == self.dtype and x.is_contiguous() and 0 < x.numel() <= self.buffer.numel()
                and n % _ALIGN == 0 and (x.storage_offset() * x.element_size()) % _ALIGN == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group, in place (the kernel copies x in before it writes the sum out)."""
        staged = self.buffer[:x.numel()].view(x.shape)
        return self._op(staged, x, "sum", self.group_name, x)


def _self_check(reducer: SymmMemAllReduce, rank: int, world_size: int, device) -> None:
    """One reduction whose sum every rank knows: rank r contributes (r + 1) * [0, 1, 2, ...]."""
    n = 4096
    x = torch.arange(n, device=device, dtype=torch.float32).mul_(rank + 1).to(reducer.dtype)
    want = torch.arange(n, device=device, dtype=torch.float32).mul_(world_size * (world_size + 1) // 2)
    got = reducer(x).float()
    torch.cuda.synchronize(device)
    if not torch.allclose(got, want.to(reducer.dtype).float(), rtol=1e-2, atol=0):
        raise RuntimeError(f"self-check sum differs (max error {(got - want).abs().max().item()})")


def _set_up(group, rank: int, world_size: int, device: torch.device, dtype: torch.dtype):
    """(this rank's checked reducer, None) or (None, why not)."""
    try:
        reducer = SymmMemAllReduce(group, device, dtype, max_bytes())
        _self_check(reducer, rank, world_size, device)
        return reducer, None
    except Exception as e:  # a missing op, a rendezvous or P2P failure, a wrong sum: NCCL instead
        return None, f"{type(e).__name__}: {e}"


def install(group, rank: int, world_size: int, device: torch.device, dtype: torch.dtype):
    """The reducer every rank agreed to use, or None (NCCL/gloo for everything). Collective on
    CUDA: every rank of the group calls it at the same point of start-up."""
    if requested() != "symm_mem" or world_size == 1:
        return None
    # Every rank has the same device kind and dtype (the executor's rule): these say no on all.
    if device.type != "cuda" or dtype not in _DTYPES:
        logger.warning("%s=symm_mem: using the group's own all-reduce (needs CUDA and bfloat16 or "
                       "float32; here %s, %s)", SWITCH, device.type, dtype)
        return None
    import torch.distributed as dist
    reducer, why = _set_up(group, rank, world_size, device, dtype)
    ok = torch.tensor([0 if reducer is None else 1],
                      device=device if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if int(ok.item()) == 0:
        logger.warning("%s=symm_mem: using NCCL instead (rank %d: %s)", SWITCH, rank,
                       why or "another rank could not set it up")
        return None
    logger.info("%s=symm_mem: one-shot all-reduce for messages up to %d bytes", SWITCH,
                reducer.buffer.numel() * dtype.itemsize)
    return reducer
