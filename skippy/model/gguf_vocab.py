"""A GGUF's vocabulary as a `tokenizers` backend, rebuilt the way transformers' GGUF
loader rebuilds it (`integrations/gguf/gguf_tokenizer_mapping.py`), so ids match that
reference. A GGUF has no tokenizer.json: it stores the vocabulary, merges and token
types as `tokenizer.ggml.*` metadata.

    tokenizer.ggml.model "gpt2"     byte-level BPE with the file's merges (SmolLM2, ...)
    tokenizer.ggml.model "llama"    SentencePiece-style BPE with byte fallback; only Gemma's
                                    vocabulary here (merges recovered from the token order)
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

TOKEN_TYPE_CONTROL = 3  # gguf TokenType.CONTROL, e.g. <|im_start|>
TOKEN_TYPE_USER_DEFINED = 4  # gguf TokenType.USER_DEFINED, e.g. <think>

# Pre-tokenizers that split with the plain GPT-2 regex in transformers. llama.cpp's
# "smollm" (and "starcoder") first splits every digit apart, which differs only
# where whitespace runs into a digit ("  1": llama.cpp ĠĠ,1; transformers Ġ,Ġ,1).
# We follow transformers, the reference the tests compare against.
GPT2_REGEX_PRE_TOKENIZERS = frozenset({"default", "gpt2", "smollm", "starcoder", "refact"})

# How these families' byte-level BPE splits text before merging: the regex of their
# tokenizer.json, which llama.cpp names by `tokenizer.ggml.pre` (and applies for it).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # digits in threes
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # every digit alone
PRE_TOKENIZER_SPLITS = {"llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT,
                        "smaug-bpe": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT}

# Architectures whose "llama" (SentencePiece) vocabulary we rebuild, as transformers does for them.
SENTENCEPIECE_ARCHITECTURES = ("gemma3",)


class TokenizerError(ValueError):
    """Tokenizer files that cannot be loaded as given."""


def backend_from_gguf(fields: Mapping[str, Any]) -> Backend:
    """The tokenizer a GGUF's metadata describes."""
    model, arch = fields.get("tokenizer.ggml.model"), fields.get("general.architecture")
    tokens: list[str] = fields.get("tokenizer.ggml.tokens")
    token_types: list[int] = fields.get("tokenizer.ggml.token_type", [])
    if model == "gpt2":
        pre = fields.get("tokenizer.ggml.pre", "default")
        if pre not in GPT2_REGEX_PRE_TOKENIZERS | PRE_TOKENIZER_SPLITS.keys():
            warnings.warn(f"GGUF pre-tokenizer {pre!r} is unknown here; splitting with the GPT-2 regex.", stacklevel=3)
        return _byte_level_bpe(tokens, token_types, fields.get("tokenizer.ggml.merges", []),
                               PRE_TOKENIZER_SPLITS.get(pre))
    if model == "llama" and arch in SENTENCEPIECE_ARCHITECTURES:
        unk = fields.get("tokenizer.ggml.unknown_token_id")
        return _gemma_bpe(tokens, token_types, None if unk is None else tokens[unk])
    raise TokenizerError(
        f"Expected tokenizer.ggml.model 'gpt2' (byte-level BPE), or 'llama' (SentencePiece) for "
        f"{', '.join(SENTENCEPIECE_ARCHITECTURES)}, got {model!r} for {arch!r}. "
        f"Fix: load the model's Hugging Face tokenizer directory instead."
    )


def _added_tokens(backend: Backend, tokens: list[str], token_types: Sequence[int], vocab: Mapping[str, int],
                  is_spelled=lambda token: True) -> Backend:
    """Control tokens as special tokens, user-defined ones (<think>) as plain added tokens:
    both matched whole, only the first skipped by skip_special_tokens."""
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types)
        if kind == TOKEN_TYPE_CONTROL and is_spelled(token)
    ]
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types)
        if kind == TOKEN_TYPE_USER_DEFINED and token in vocab
    ]
    backend.add_special_tokens(control)
    backend.add_tokens(user_defined)
    return backend


def _byte_alphabet() -> dict[int, str]:
    # GPT-2's byte -> printable-character table, as in transformers' bytes_to_unicode.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


def _byte_level_bpe(tokens: list[str], token_types: Sequence[int], merges: list[str],
                    split: str | None = None) -> Backend:
    """GPT-2 style BPE over the GGUF vocabulary, with control tokens kept whole; text is
    split by `split` (a regex) before the byte mapping, else by GPT-2's own regex."""
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())

    def spelled(token: str) -> str:
        # Regular tokens are already written in the byte alphabet; respell any that are not.
        return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {spelled(token): index for index, token in enumerate(tokens)}
    backend = Backend(
        models.BPE(
            vocab=vocab,
            merges=[tuple(merge.split(" ")) for merge in merges],
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    backend.pre_tokenizer = byte_level if split is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
    backend.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel; transformers skips it too.
    return _added_tokens(backend, tokens, token_types, vocab, is_spelled=lambda token: set(token) <= alphabet)


def _gemma_bpe(tokens: list[str], token_types: Sequence[int], unk_token: str | None) -> Backend:
    """Gemma's BPE as transformers builds it from a GGUF (`gemma_tokenizer`, then
    GemmaTokenizer): spaces normalized to "▁", byte fallback, and two fixes of the file.

    1. A token of two or more spaces is stored as real spaces ("  "); the model looks it
       up as "▁▁", so those tokens are respelled first.
    2. The file lists no merges; they are recovered from the vocabulary, each token's
       splits into two tokens, ranked by the token's position in the file (Gemma's
       scores do not follow its merge order; its token order does).
    """
    respelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(respelled)}
    backend = Backend(models.BPE(vocab=vocab, merges=_merges_by_position(respelled, vocab), fuse_unk=True,
                                 unk_token=unk_token, byte_fallback=True, dropout=None))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return _added_tokens(backend, tokens, token_types, backend.get_vocab(with_added_tokens=False))


def _merges_by_position(tokens: list[str], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary tokens, in the order transformers'
    generate_merges gives them with position scores: tokens by their (last) place in the
    file, and within a token the longer left part first."""
    merges = []
    for index, token in enumerate(tokens):
        if vocab[token] != index:  # listed again further on: it ranks there
            continue
        for split in range(len(token) - 1, 0, -1):
            left, right = token[:split], token[split:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges
