"""Reference models, each a builder of graph nodes whose parameter names match PyTorch's."""

from .mlp import mlp

__all__ = ["mlp"]
