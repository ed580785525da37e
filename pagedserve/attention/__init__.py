"""Paged attention: metadata, the Attention module models call, and its kernel backends."""
from pagedserve.attention.backend import Attention, get_backend
from pagedserve.attention.metadata import AttentionMetadata

__all__ = ["Attention", "AttentionMetadata", "get_backend"]
