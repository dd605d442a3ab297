"""Running models: caches, trees, sampling, the speculative round and the `LLM` API."""
