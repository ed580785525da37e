"""InflightStep: a step launched ahead of its tokens (overlapped steps, EngineConfig.async_scheduling).

Its own module so that both halves of the engine's step (step_pipeline.py launches it,
token_application.py processes it one step late) take it from here and neither imports the other.
"""
from __future__ import annotations

import dataclasses

import torch

from pagedserve.runner.async_output import AsyncHostCopy


@dataclasses.dataclass
class InflightStep:
    """A launched step whose sampled tokens the host has not processed yet."""
    sampled: list                 # ScheduledSequence rows that sample, in the order of tokens
    tokens: torch.Tensor          # [len(sampled)] sampled ids on the device (the next step's placeholders)
    copy: AsyncHostCopy
    processed: bool = False       # its tokens appended already (during the next step's mask fill)
