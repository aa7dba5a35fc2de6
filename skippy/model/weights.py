"""Which tensors a stage needs, named as in GGUF (`blk.N.attn_q.weight`)."""

from __future__ import annotations

from .args import LayerRange

BLOCK_TENSORS = (
    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
    "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
)  # fmt: skip


def needed_tensor_names(layers: LayerRange, tie_word_embeddings: bool) -> list[str]:
    """The sparse-load rule: only this stage's blocks, the embedding on the first
    stage, the output norm and head on the last (the tied head reuses the embedding)."""
    names = []
    if layers.is_first or (layers.is_last and tie_word_embeddings):
        names.append("token_embd.weight")
    for i in range(layers.start, layers.end):
        names += [f"blk.{i}.{t}.weight" for t in BLOCK_TENSORS]
    if layers.is_last:
        names.append("output_norm.weight")
        if not tie_word_embeddings:
            names.append("output.weight")
    return names
