"""The FP8 format every quantized op shares (e4m3, as the H200's tensor cores take it): its torch
dtype, its largest value and the smallest scale. Apart from the ops so that the Triton kernels and
the torch ops read them from one place without importing each other."""
import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# A row of zeros must not divide by zero: its scale is this floor and its values stay 0.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
