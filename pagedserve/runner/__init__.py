"""The runner: turns a SchedulerOutput into tensors and a forward pass (ModelRunner), and owns the
KV pools (CacheEngine)."""
