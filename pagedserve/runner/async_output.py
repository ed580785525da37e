"""AsyncHostCopy: a step's sampled tokens on their way to the host while the next step runs.

On CUDA the copy runs on a side stream that first waits for the compute stream (so it starts
once the sampling kernels are done), into pinned memory, and ends with an event; result() waits
on that event alone, never on the compute stream, so kernels queued after the sampling (the next
step) keep running. On the CPU there is nothing to overlap: result() reads the tensor.
"""
from __future__ import annotations

import torch

from pagedserve.layers.sampler import DeviceSample, SamplerOutput

_side_streams: dict[torch.device, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream


class AsyncHostCopy:
    def __init__(self, sample: DeviceSample):
        packed = sample.packed()
        self.want = sample.want
        self._event = None
        self._result = None
        if packed.device.type != "cuda":
            self._host = packed
            return
        stream = _side_stream(packed.device)
        stream.wait_stream(torch.cuda.current_stream(packed.device))
        with torch.cuda.stream(stream):
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(stream)
        # The caching allocator must not hand packed's memory to the compute stream before the copy ends.
        packed.record_stream(stream)
        self._host = host
        self._result: SamplerOutput | None = None

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def result(self) -> SamplerOutput:
        """The host lists; waits for this copy only. Kept: a grammar step reads it early (to fill the
        next step's mask) and the engine again when it appends the tokens."""
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            self._result = SamplerOutput.from_packed(self._host, self.want)
        return self._result
