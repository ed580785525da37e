"""What a model family cannot do is refused in one line at construction, not served wrong."""
import pytest

from pagedserve.models.gemma import Gemma3ForCausalLM
from tiny_models import tiny_config


@pytest.mark.parametrize("field,value,match", [("use_bidirectional_attention", True, "use_bidirectional_attention"),
                                               ("hidden_activation", "gelu", "hidden_activation 'gelu'"),
                                               ("layer_types", ["full_attention", "chunked_attention"],
                                                "chunked_attention")])
def test_gemma_refuses_what_its_kernels_do_not_do(field, value, match):
    cfg = tiny_config("gemma3", 384)
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=match):
        Gemma3ForCausalLM(cfg)
