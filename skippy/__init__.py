"""skippy: serve one language model from a chain of layer-sliced stages."""

__version__ = "0.1.0"
