"""The OpenAI-compatible HTTP layer: schemas, routes, SSE, admission, errors, metrics.

It reaches the model only through `skippy.driver.backend.GenerationBackend`; it knows
nothing of frames, stages or torch."""
