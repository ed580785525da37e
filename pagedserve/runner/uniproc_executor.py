"""UniProcExecutor: the executor of a one-rank engine (tensor_parallel_size == 1), a thin shell
over one ModelRunner in this process that answers the same calls as MultiProcExecutor
(executor.py), so the engine never knows which one it got."""
from __future__ import annotations

from pagedserve.runner.tp_worker import DEFAULT_RUNNER, _resolve


class UniProcExecutor:
    """tensor_parallel_size == 1: a thin shell over one ModelRunner."""

    world_size = 1

    def __init__(self, config, hf_config, device, dtype, runner_factory: str | None = None):
        self.runner = _resolve(runner_factory or DEFAULT_RUNNER)(config, hf_config, device, dtype)

    def execute(self, plan, prev_sampled=None, sample=None):
        """The step's logits; with sample (an overlapped step's sampler), sample(logits) instead
        (None when nothing samples), as MultiProcExecutor.execute returns."""
        logits = self.runner.execute(plan, prev_sampled)
        if sample is None:
            return logits
        return None if logits is None or logits.shape[0] == 0 else sample(logits)

    def shutdown(self) -> None:
        pass

    def __getattr__(self, name):
        # Only reached for names this class lacks: the runner's own methods and attributes.
        if name == "runner":
            raise AttributeError(name)
        return getattr(self.runner, name)
