"""Text to token ids and back, for a GGUF file (its vocabulary rebuilt by gguf_vocab.py)
or a Hugging Face tokenizer directory."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from skippy.model.chat_template import FAMILY_TEMPLATES, ChatTemplate, ChatTemplateError
from skippy.model.gguf_file import GGUFFile
from skippy.model.gguf_vocab import TokenizerError, backend_from_gguf

__all__ = ["IncrementalDecoder", "Tokenizer", "TokenizerError"]
log = logging.getLogger(__name__)

# Texts that end a turn besides EOS: the common entries of llama.cpp's end-of-generation list.
EOG_TOKEN_TEXTS = (
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
    "<end_of_turn>", "<|end_of_text|>", "<EOT>", "<|return|>", "<|call|>",
)  # fmt: skip


def _config_token_id(backend: Backend, config: Mapping[str, Any], key: str) -> int | None:
    # tokenizer_config.json writes a token as "<s>" or as {"content": "<s>", ...}.
    token = config.get(key)
    if isinstance(token, Mapping):
        token = token.get("content")
    if token is None:
        return None
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise TokenizerError(f"Expected {key} {token!r} to be in the vocabulary, got no such token.")
    return token_id


def _hf_chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    # transformers >= 4.43 saves the template beside the config, and prefers that file.
    jinja_path = directory / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        # Older configs hold named templates: [{"name": "default", "template": ...}, ...].
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class Tokenizer:
    """Encode and decode text, and render chat prompts, for one model."""

    def __init__(
        self, backend: Backend, *, bos_id: int | None, eos_id: int, add_bos: bool, chat_template: str | None
    ):
        self._backend = backend
        self._bos_id = bos_id
        self._eos_id = eos_id
        self._add_bos = add_bos
        self._chat_template_source = chat_template
        self._chat_template: ChatTemplate | None = None  # compiled on first use
        vocab = backend.get_vocab(with_added_tokens=True)
        eog = {eos_id} | {vocab[text] for text in EOG_TOKEN_TEXTS if text in vocab}
        self._eog_ids = frozenset(eog)

    @classmethod
    def from_gguf(cls, source: str | os.PathLike | GGUFFile) -> Tokenizer:
        """Build from a GGUF's `tokenizer.ggml.*` metadata; pass an open file to avoid re-parsing."""
        fields = (source if isinstance(source, GGUFFile) else GGUFFile(source)).fields
        eos_id = fields.get("tokenizer.ggml.eos_token_id")
        if eos_id is None:
            raise TokenizerError(
                "Expected tokenizer.ggml.eos_token_id in the GGUF, got none. Fix: re-convert the model with llama.cpp."
            )
        # a SentencePiece file that does not say adds BOS, as llama.cpp (and transformers) assume
        add_bos = fields.get("tokenizer.ggml.add_bos_token", fields.get("tokenizer.ggml.model") == "llama")
        template, arch = fields.get("tokenizer.chat_template"), fields.get("general.architecture")
        if template is None and arch in FAMILY_TEMPLATES:
            log.info("%s GGUF without a chat template: using the %s family's own", arch, arch)
            template = FAMILY_TEMPLATES[arch]
        return cls(
            backend_from_gguf(fields),
            bos_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_id=eos_id,
            add_bos=bool(add_bos),
            chat_template=template,
        )

    @classmethod
    def from_model(cls, path: str | os.PathLike) -> Tokenizer:
        """The tokenizer of a model path: a Hugging Face directory or a GGUF file (through
        the loader's cached reader, so the weights' load does not parse it again)."""
        from .gguf_loader import open_gguf  # local: the tokenizer alone needs no torch

        path = Path(path)
        return cls.from_hf_dir(path) if path.is_dir() else cls.from_gguf(open_gguf(path))

    @classmethod
    def from_hf_dir(cls, directory: str | os.PathLike) -> Tokenizer:
        """Build from tokenizer.json, plus tokenizer_config.json / chat_template.jinja when present."""
        directory = Path(directory)
        tokenizer_json = directory / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise TokenizerError(
                f"Expected {tokenizer_json} to exist, got no such file. Fix: point at a Hugging Face model directory."
            )
        backend = Backend.from_file(str(tokenizer_json))
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        bos_id = _config_token_id(backend, config, "bos_token")
        eos_id = _config_token_id(backend, config, "eos_token")
        if eos_id is None:
            eos_id = next((i for i in map(backend.token_to_id, EOG_TOKEN_TEXTS) if i is not None), None)
        if eos_id is None:
            raise TokenizerError(
                f"Expected an eos_token in {config_path}, got none. Fix: add \"eos_token\" to tokenizer_config.json."
            )
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # No flag: BOS is added if tokenizer.json's post-processor adds it.
            add_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        chat_template = _hf_chat_template(directory, config)
        return cls(backend, bos_id=bos_id, eos_id=eos_id, add_bos=bool(add_bos), chat_template=chat_template)

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def eog_ids(self) -> frozenset[int]:
        """Ids that end generation: EOS plus turn-end tokens such as <|im_end|>."""
        return self._eog_ids

    @property
    def add_bos(self) -> bool:
        return self._add_bos

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template_source

    def with_chat_template(self, source: str) -> Tokenizer:
        """This tokenizer with another chat template (a served model's template override)."""
        return Tokenizer(self._backend, bos_id=self._bos_id, eos_id=self._eos_id, add_bos=self._add_bos,
                         chat_template=source)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`. Special-token text such as "<|im_start|>" always becomes its single id."""
        # The backend's own post-processor is bypassed so BOS follows add_bos alone, for both sources.
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self._add_bos and self._bos_id is not None:
            return [self._bos_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, text: str) -> int | None:
        return self._backend.token_to_id(text)

    def to_json(self) -> str:
        """The `tokenizers` JSON of the backend (tokenizer.json's format): what the grammar
        engine reads the vocabulary from."""
        return self._backend.to_str()

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text for a conversation, rendered with the model's chat template."""
        if self._chat_template is None:
            if self._chat_template_source is None:
                raise ChatTemplateError(
                    "Expected the model to carry a chat template, got none. "
                    "Fix: pass --raw to send the prompt as plain text."
                )
            self._chat_template = ChatTemplate(
                self._chat_template_source,
                bos_token=self._token_text(self._bos_id),
                eos_token=self._token_text(self._eos_id),
            )
        return self._chat_template.render(messages, add_generation_prompt, **extra)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **extra: Any) -> list[int]:
        """The prompt ids for a conversation. As transformers' apply_chat_template(tokenize=True):
        no BOS of ours, since templates that want one write it (Gemma's, Llama 3's)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra), add_special_tokens=False)

    def _token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._backend.id_to_token(token_id)


class IncrementalDecoder:
    """Turn a stream of token ids into text pieces without splitting a UTF-8 character.

    A byte-level token can end mid-character; decoding it alone yields U+FFFD.
    We decode a short window (the previous piece's tokens plus the new ones) and
    hold text back while it ends in U+FFFD. Cutting the window only after a whole
    character keeps the joined pieces equal to decoding all ids at once; the
    previous piece stays in the window so decoders that treat the first token
    specially (sentencepiece's leading space) see the same context.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: first token of the previous piece
        self._read_offset = 0  # first token not yet emitted

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        self._ids.append(token_id)
        return self._emit(is_final=False)

    def flush(self) -> str:
        """Return whatever is held back, even an incomplete character (as U+FFFD)."""
        return self._emit(is_final=True)

    def _emit(self, is_final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        decode = self._tokenizer.decode
        emitted = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special_tokens)
        text = decode(self._ids[self._prefix_offset :], self._skip_special_tokens)
        if text.endswith("\ufffd") and not is_final:
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(emitted) :]
