"""Running models: trees, sampling, the speculative round, its states and graphs, and the
`LLM` API."""
