"""Structured outputs in the engine (issue #32): grammars compiled off the step loop, per-sequence
matchers, and the per-step token bitmask applied to the logits before sampling (xgrammar).

compiler.py: spec -> Grammar (synchronous, the 400 for a bad spec), the compile pool and its cache.
matchers.py: one GrammarMatcher per sequence; forks copy it, preemption never touches it.
masks.py: the step's host and device bitmask buffers; fill_pool.py: long-lived fill threads (opt-in).
manager.py: StructuredOutputs, what the engine calls: submit / poll / fill / apply / forget.
Lives outside core/ (core never imports torch or xgrammar).
"""
from pagedserve.engine.structured.manager import StructuredOutputs

__all__ = ["StructuredOutputs"]
