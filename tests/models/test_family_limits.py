"""What a model family cannot do is refused in one line at construction, not served wrong."""
import pytest

from pagedserve.models.gemma import Gemma3ForCausalLM
from pagedserve.models.olmo2 import Olmo2ForCausalLM
from tiny_models import tiny_config


def test_olmo2_refuses_tensor_parallelism():
    """Its q/k norms span every head; a rank holds some."""
    with pytest.raises(ValueError, match="tensor_parallel_size: OLMo 2's q/k norms span every head"):
        Olmo2ForCausalLM(tiny_config("olmo2", 384), tp_rank=0, tp_size=2)


@pytest.mark.parametrize("field,value,match", [("use_bidirectional_attention", True, "use_bidirectional_attention"),
                                               ("hidden_activation", "gelu", "hidden_activation 'gelu'"),
                                               ("layer_types", ["full_attention", "chunked_attention"],
                                                "chunked_attention")])
def test_gemma_refuses_what_its_kernels_do_not_do(field, value, match):
    cfg = tiny_config("gemma3", 384)
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=match):
        Gemma3ForCausalLM(cfg)
