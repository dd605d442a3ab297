"""Structured outputs: constraints on a request's text (JSON schema, JSON object, regex, choice,
EBNF grammar)."""
from treeflash.structured.grammar import StructuredOutputs

__all__ = ["StructuredOutputs"]
