"""Mixture-of-experts as a layer: routing (routing.py), the expert-sorted, block-padded layout
(align.py), the grouped GEMM in Triton (triton_moe.py) with tuned block sizes (config.py,
configs/*.json), the plain torch path (reference.py), and the module models compose (layer.py)."""
from pagedserve.layers.fused_moe.layer import FusedMoE, fused_experts
from pagedserve.layers.fused_moe.routing import select_experts

__all__ = ["FusedMoE", "fused_experts", "select_experts"]
