"""Errors raised while loading a model; each names the cause and the fix."""


class ModelLoadError(RuntimeError):
    pass


class ContextOverflowError(ValueError):
    """A session would grow past the context size its KV cache was given."""


class RequestError(ValueError):
    """What one request asks of the model that it cannot do: a token id outside the
    vocabulary, a non-finite activation or logit, sampling settings that leave no token to
    draw. That request fails with this reason; every other request goes on (a stage logs it
    as its peer's fault, without a traceback)."""
