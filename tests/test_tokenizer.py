"""Tokenizer, streaming detokenizer and chat template against transformers, which
loads the same GGUF (the `hf_tokenizer` session fixture)."""

from __future__ import annotations

import json
import shutil

import pytest
import transformers  # the oracle: missing, it fails the run (never a skip)

from skippy.model.chat_template import ChatTemplate, ChatTemplateError
from skippy.model.gguf_loader import open_gguf
from skippy.model.tokenizer import IncrementalDecoder, Tokenizer

TEXTS = [
    "",  # empty string
    "Hello, world!",  # plain ASCII with punctuation
    " leading space",  # one leading space
    "    four leading spaces",  # a run of leading spaces
    "Café, naïve, façade, Ångström",  # Latin accents (two-byte UTF-8)
    "日本語のテキストと中文字符",  # CJK (three-byte UTF-8)
    "emoji 😀🎉 and family 👨‍👩‍👧",  # four-byte emoji and a ZWJ sequence
    "def f(x):\n    if x:\n        return x * 2\n\treturn None\n",  # code: spaces and tab indentation
    "a  b   c\n\n\nd\t\te \r\n f",  # runs of spaces, newlines, tabs, CRLF
    "  1 and x  12",  # whitespace running into digits (where llama.cpp's smollm differs)
    "pi = 3.14159265358979, n = 1000000007, 2024-01-31",  # digits and long numbers
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",  # special tokens inline
    "x<|endoftext|>y <jupyter_code> z",  # special tokens glued to text
    "<|im_start",  # an unfinished special token is plain text
    "It's we'll they're I'M",  # contractions the GPT-2 regex splits
    "\n",  # a lone newline
]

STREAM_TEXTS = [
    "emoji 😀🎉 and family 👨‍👩‍👧",  # emoji whose bytes span several tokens
    "日本語のテキストと中文字符",  # CJK characters split across byte tokens
    "Café, naïve, façade, Ångström",  # accents
    "def f(x):\n    if x:\n        return x * 2\n",  # code
    "<|im_start|>user\nhi<|im_end|>\n",  # special tokens
]


@pytest.fixture(scope="session")
def tokenizer(gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="session")
def hf_dir(hf_tokenizer, tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf_tokenizer")
    hf_tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode(text) == hf_tokenizer.encode(text)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text == hf_tokenizer.decode(ids)
    assert tokenizer.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_special_ids_match_metadata(tokenizer, hf_tokenizer):
    assert tokenizer.bos_id == 1 == hf_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.eos_id == 2 == hf_tokenizer.eos_token_id
    assert tokenizer.eog_ids == frozenset({0, 2})  # <|im_end|> and <|endoftext|>
    assert tokenizer.vocab_size == 49152 == len(hf_tokenizer)
    # add_bos_token is false in this GGUF, so add_special_tokens adds nothing.
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode("hi", add_special_tokens=False)
    assert tokenizer.encode("<|im_start|>") == [1]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_incremental_decoder_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.push(token_id) for token_id in ids]
    pieces.append(decoder.flush())
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)


def test_incremental_decoder_holds_split_emoji(tokenizer):
    ids = tokenizer.encode("😀")
    assert len(ids) > 1 and tokenizer.decode(ids[:1]).endswith("\ufffd")  # the case under test really occurs
    decoder = IncrementalDecoder(tokenizer)
    assert [decoder.push(token_id) for token_id in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.push(ids[-1]) == "😀"
    assert decoder.flush() == ""


def test_incremental_decoder_flush_releases_partial_character(tokenizer):
    partial = tokenizer.encode("😀")[:1]
    decoder = IncrementalDecoder(tokenizer)
    assert decoder.push(partial[0]) == ""
    assert decoder.flush() == tokenizer.decode(partial)


def test_from_hf_dir_matches_gguf(tokenizer, hf_dir):
    hf = Tokenizer.from_hf_dir(hf_dir)
    assert (hf.bos_id, hf.eos_id, hf.eog_ids) == (tokenizer.bos_id, tokenizer.eos_id, tokenizer.eog_ids)
    assert hf.chat_template == tokenizer.chat_template
    assert [hf.encode(text) for text in TEXTS] == [tokenizer.encode(text) for text in TEXTS]


def test_from_hf_dir_honours_add_bos_token(hf_dir, tmp_path):
    shutil.copy(hf_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "add_bos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.encode("hi") == [1, *tok.encode("hi", add_special_tokens=False)]


def test_missing_chat_template_suggests_raw(hf_dir, tmp_path):
    shutil.copy(hf_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = Tokenizer.from_hf_dir(tmp_path)  # no config: EOS found from the end-of-turn table
    assert tok.chat_template is None and tok.eos_id in tok.eog_ids
    with pytest.raises(ChatTemplateError, match="--raw"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello. 👋"},
    {"role": "user", "content": "Name a prime."},
]

TEMPLATE_CASES = [
    # single user message: the template adds its default system prompt
    ([{"role": "user", "content": "Hello"}], [{"role": "user", "content": "Hello"}], True),
    # system + user + assistant + user history
    (HISTORY, HISTORY, True),
    # content as text parts, joined with "" before rendering
    (
        [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}],
        [{"role": "user", "content": "Hello"}],
        True,
    ),
    # no generation prompt: ends after the last message
    (HISTORY, HISTORY, False),
]


@pytest.mark.parametrize(("messages", "hf_messages", "add_generation_prompt"), TEMPLATE_CASES)
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer, messages, hf_messages, add_generation_prompt):
    expected = hf_tokenizer.apply_chat_template(
        hf_messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


BAD_MESSAGES = [
    # unknown role
    ([{"role": "wizard", "content": "hi"}], "role"),
    # a non-text part is named by its type
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "image_url"),
    # content that is neither a string nor a list of parts
    ([{"role": "user", "content": 42}], "int"),
    # missing content
    ([{"role": "user"}], "content"),
    # a message that is not an object
    (["hi"], "messages\\[0\\]"),
]


@pytest.mark.parametrize(("messages", "match"), BAD_MESSAGES)
def test_chat_template_rejects_bad_messages(tokenizer, messages, match):
    with pytest.raises(ValueError, match=match):
        tokenizer.apply_chat_template(messages)


def test_template_helpers_are_available():
    template = ChatTemplate(
        "{{ bos_token }}{{ strftime_now('%Y') | length }}{{ {'k': 'é'} | tojson }}"
        "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}",
        bos_token="<s>",
        eos_token="</s>",
    )
    assert template.render([{"role": "user", "content": "a"}]) == '<s>4{"k": "é"}'
    with pytest.raises(ChatTemplateError, match="one message only"):
        template.render([{"role": "user", "content": "a"}] * 2)


def test_template_sandbox_blocks_attribute_escape():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}", bos_token=None, eos_token=None)
    with pytest.raises(ChatTemplateError):
        template.render([])


# Llama 3 and Qwen GGUFs split text with their own regex before merging (digits in threes,
# or one by one). SmolLM2's vocabulary written under each pre-tokenizer name: ours against
# transformers loading the same GGUF.
SPLIT_TEXT = "In 2024, 1234567 people said: I'm   here!\n\n\tDON'T 3.14159 x=42;"


def vocabulary_gguf(source, path, pre: str):
    import gguf

    fields = open_gguf(source).fields
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, add in (("llama.block_count", writer.add_block_count), ("llama.context_length", writer.add_context_length),
                     ("llama.embedding_length", writer.add_embedding_length),
                     ("llama.feed_forward_length", writer.add_feed_forward_length),
                     ("llama.attention.head_count", writer.add_head_count),
                     ("llama.attention.head_count_kv", writer.add_head_count_kv)):
        add(fields[key])
    writer.add_layer_norm_rms_eps(fields["llama.attention.layer_norm_rms_epsilon"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    writer.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt2"])
def test_family_pre_tokenizers_match_transformers(gguf_path, tmp_path, pre):
    path = vocabulary_gguf(gguf_path, tmp_path / f"{pre}.gguf", pre)
    ours = Tokenizer.from_model(path)
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in (SPLIT_TEXT, *TEXTS):
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False), text
        # the split itself (SmolLM2's vocabulary never merges digits, so ids alone hide a wrong one)
        assert (ours._backend.pre_tokenizer.pre_tokenize_str(text)
                == reference.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)), text


def test_the_family_splits_differ(gguf_path, tmp_path):
    """So the test above would fail with the wrong regex: the three split SPLIT_TEXT apart."""
    splits = {pre: Tokenizer.from_model(vocabulary_gguf(gguf_path, tmp_path / f"{pre}.gguf", pre))
              ._backend.pre_tokenizer.pre_tokenize_str(SPLIT_TEXT) for pre in ("llama-bpe", "qwen2", "gpt2")}
    assert len({tuple(pieces) for pieces in map(lambda s: [p for p, _ in s], splits.values())}) == 3
