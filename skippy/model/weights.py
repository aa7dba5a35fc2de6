"""Which tensors a stage needs, named as in GGUF (`blk.N.attn_q.weight`)."""

from __future__ import annotations

from .architecture import BASE_BLOCK_TENSORS, LLAMA, Architecture
from .args import LayerRange

BLOCK_TENSORS = BASE_BLOCK_TENSORS  # a llama block's; Architecture.block_tensors adds the others'


def needed_tensor_names(layers: LayerRange, tie_word_embeddings: bool, arch: Architecture = LLAMA) -> list[str]:
    """The sparse-load rule: only this stage's blocks, the embedding on the first
    stage, the output norm and head on the last (the tied head reuses the embedding)."""
    names = []
    if layers.is_first or (layers.is_last and tie_word_embeddings):
        names.append("token_embd.weight")
    for i in range(layers.start, layers.end):
        names += [f"blk.{i}.{t}" for t in arch.block_tensors]
    if layers.is_last:
        names.append("output_norm.weight")
        if not tie_word_embeddings:
            names.append("output.weight")
    return names
