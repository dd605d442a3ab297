"""`treeflash serve`: an OpenAI-compatible HTTP server over one `LLM` (needs the `serve` extra)."""
