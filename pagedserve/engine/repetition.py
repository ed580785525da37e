"""vLLM's repetition_detection: does a sequence's output end in a repeated token pattern?

A pattern of k tokens (min_pattern_size <= k <= max_pattern_size) counts once its last k tokens
appeared min_count times back to back at the end of the output: "a b c a b c" ends in "a b c"
twice. Checked after each token, so the cost is at most max_pattern_size * min_count
comparisons per token, and only for requests that ask.
"""
from __future__ import annotations

from typing import Sequence

from pagedserve.sampling_params import RepetitionDetectionParams

STOP_REASON = "repetition_detected"


def ends_in_repetition(output: Sequence[int], params: RepetitionDetectionParams) -> bool:
    """Whether output ends with some pattern of allowed size repeated min_count times."""
    count = params.min_count
    if params.max_pattern_size <= 0 or count < 2:
        return False
    n = len(output)
    for k in range(max(params.min_pattern_size, 1), params.max_pattern_size + 1):
        if k * count > n:
            return False
        tail = output[n - k:]
        if all(output[n - k * (r + 1):n - k * r] == tail for r in range(1, count)):
            return True
    return False
