"""The admission queue's default (admission.default_max_waiting): the KV cache's blocks, at most
8 batches deep, never below one batch."""
from pagedserve.entrypoints.openai.admission import default_max_waiting


def test_the_default_waiting_queue_follows_the_kv_cache_within_bounds():
    assert default_max_waiting(num_gpu_blocks=512, max_num_seqs=128) == 512     # the blocks
    assert default_max_waiting(num_gpu_blocks=95_000, max_num_seqs=1024) == 8192  # 8 batches
    assert default_max_waiting(num_gpu_blocks=64, max_num_seqs=256) == 256      # one batch
