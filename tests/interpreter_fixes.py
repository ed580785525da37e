"""Two fixes to Triton 3.6's interpreter, applied before any kernel module is imported.

1. It turns a scalar into a loop bound with int(ndarray of shape [1]), which numpy >= 2.4
   refuses; the same patch with .item() works with every numpy.
2. It rounds float32 -> bfloat16 toward zero on a plain cast (and half-up with rtne), where the
   GPU rounds to nearest even; the bit-level rounding order of the fused kernels can only be
   checked against torch if the interpreter rounds like the GPU, so that cast goes through torch.
   Its float32 -> float8e4nv cast flushes e4m3's subnormals (|x| < 2^-6) to zero and rounds
   half-up, and widens float8e4nv -> bfloat16 with the wrong exponent bias; the FP8 KV cache is
   checked bit for bit, so those casts go through torch too.
"""
import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter


def _index_scalars_with_item(original):
    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))
    return patched


def _bf16_round_to_nearest_even(original):
    def convert(data, src, dst, rounding_mode):
        if src == tl.float32 and dst == tl.bfloat16:
            as_bf16 = torch.from_numpy(np.array(data, dtype=np.float32)).to(torch.bfloat16)
            return as_bf16.view(torch.int16).numpy().view(np.uint16)
        if src == tl.float32 and dst == tl.float8e4nv:
            as_fp8 = torch.from_numpy(np.array(data, dtype=np.float32)).to(torch.float8_e4m3fn)
            return as_fp8.view(torch.uint8).numpy()
        if src == tl.float8e4nv and dst == tl.bfloat16:  # its 8 -> 16 bit widening mis-biases the exponent
            as_fp8 = torch.from_numpy(np.array(data, dtype=np.uint8)).view(torch.float8_e4m3fn)
            return as_fp8.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return original(data, src, dst, rounding_mode)
    return convert


def apply() -> None:
    if not getattr(interpreter, "_pagedserve_fixed", False):
        interpreter._patch_lang_tensor = _index_scalars_with_item(interpreter._patch_lang_tensor)
        interpreter._convert_float = _bf16_round_to_nearest_even(interpreter._convert_float)
        interpreter._pagedserve_fixed = True
