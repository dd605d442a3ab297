"""Structured outputs: constraints on a request's text (JSON schema, regex, choice)."""
from treeflash.structured.grammar import StructuredOutputs

__all__ = ["StructuredOutputs"]
