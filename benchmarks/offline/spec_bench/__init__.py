"""The pieces of benchmarks/offline/spec_decode_bench.py (issue #36), one side each: common (the set-up
both engines share), weights (the shared checkpoint and its fingerprint), ours (pagedserve), vllm_side
(vLLM; not `vllm`, which would shadow the package on sys.path), collect (the parts -> one result).
spec_decode_bench.py is the command line and says what each section measures.

Importing any of them costs the standard library only: each side imports its engine when it runs,
so the vLLM process (vLLM's own torch first on the path) never imports pagedserve's engine."""
