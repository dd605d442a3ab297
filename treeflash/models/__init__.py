"""Architectures: dense targets (Qwen3, Llama) and the DFlash drafter."""
