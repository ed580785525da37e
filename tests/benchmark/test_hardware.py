"""The roofline's copy test must fit beside an engine that took its share of the device: on an
80 GB H100 at --gpu-memory-utilization 0.9 about 3.6 GiB was free, and two 4 GiB buffers failed
(50th session). The sizing is plain arithmetic, checked here without a GPU."""
from pagedserve.benchmark.hardware import copy_buffer_bytes

GiB = 1 << 30


def test_copy_buffer_takes_a_third_of_the_free_memory_when_that_is_under_4_gib():
    free = int(3.62 * GiB)  # what the H100 had free beside the nanovllm engine
    n = copy_buffer_bytes(free)
    assert n <= free // 3 and free // 3 - n < 4096  # a buffer of n bytes and its copy: 2/3 of it
    assert n % 4096 == 0


def test_copy_buffer_is_4_gib_on_a_roomy_device():
    assert copy_buffer_bytes(100 * GiB) == 4 * GiB


def test_copy_buffer_never_below_256_mib():
    assert copy_buffer_bytes(10 << 20) == 256 << 20
