"""Errors raised while loading a model; each names the cause and the fix."""


class ModelLoadError(RuntimeError):
    pass


class ContextOverflowError(ValueError):
    """A session would grow past the context size its KV cache was given."""
