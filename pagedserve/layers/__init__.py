"""Building blocks for models: norms, rotary embeddings, tensor-parallel linear layers, weight loaders."""
