"""Stage 0's driving: the `ChainClient` (lanes, return listener), one request's `ChainSession`
over the wire or in-process, the `ChainDecoder` loop, and the `GenerationBackend` seam
(backend.py) that the API layer calls. Knows frames and stages; knows nothing of HTTP."""
