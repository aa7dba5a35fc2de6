"""The GGUF block types our kernel keeps quantized, and their layouts' sizes: torch-free, so
that a process can ask what a file will run on before torch loads (model/threads.py)."""

from __future__ import annotations

from gguf import GGMLQuantizationType as Q

LEGACY_BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q5_0: 22, Q.Q5_1: 24, Q.Q8_0: 34}  # 32 weights a block
K_QUANT_BLOCK_BYTES = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}  # 256 weights a super-block
SUPPORTED = tuple(LEGACY_BLOCK_BYTES) + tuple(K_QUANT_BLOCK_BYTES)
BITS = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q4_K: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q5_K: 5, Q.Q8_0: 8, Q.Q6_K: 6}
