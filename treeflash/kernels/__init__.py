"""Triton kernels (GPU only). `tree_attention` is a drop-in for
`layers.attention.sdpa_attention`: same arguments, same result."""
from treeflash.kernels.tree_attention import tree_attention

__all__ = ["tree_attention"]
