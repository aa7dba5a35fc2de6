"""The speculative flags of `skippy generate` and `skippy serve` (one process: no stage processes)."""

from __future__ import annotations

import asyncio
import json

import pytest

from skippy import cli
from skippy.driver.backend import Finished, GenerationRequest, Token
from skippy.launch.serve import ServeConfig, build_backend
from skippy.protocol import SamplingConfig

PROMPT = "Repeat the following text exactly: the quick brown fox jumps over the lazy dog, twice."


def generate_json(capsys, *flags: str) -> dict:
    assert cli.main(["generate", "--json", "--max-tokens", "24", "--ctx-size", "512", *flags, PROMPT]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_one_process_with_speculation_equals_without(capsys):
    off = generate_json(capsys)
    on = generate_json(capsys, "--speculative", "ngram-suffix", "--speculative-max-window", "6")
    assert on["completion_ids"] == off["completion_ids"]


def test_generate_refuses_draft_without_a_draft_model(capsys):
    assert cli.main(["generate", "--speculative", "draft", PROMPT]) == 2
    assert "--draft-model" in capsys.readouterr().err


def test_serve_one_stage_with_speculation_is_a_chain_of_one(gguf_path, tokenizer):
    config = ServeConfig(model=gguf_path, num_stages=1, ctx_size=512, concurrency=1,
                         speculative="ngram-simple", kv_cache_bytes=0)
    ids = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])

    async def main():
        backend = await build_backend(config)
        try:
            assert backend.speculative.mode == "ngram-simple"
            request = GenerationRequest("r", ids, 24, SamplingConfig(), tokenizer.eog_ids)
            events = [event async for event in backend.generate(request)]
        finally:
            await backend.close()
        return events

    events = asyncio.run(main())
    tokens = [e.token_id for e in events if isinstance(e, Token)]
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.extra["speculative_mode"] == "ngram-simple"
    assert finished.num_completion_tokens == len(tokens) > 0


def test_serve_config_checks_the_speculative_settings(gguf_path):
    with pytest.raises(ValueError, match="--draft-model"):
        ServeConfig(model=gguf_path, speculative="draft")
    with pytest.raises(ValueError, match="min_window <= max_window"):
        ServeConfig(model=gguf_path, speculative="ngram-suffix", speculative_min_window=9,
                    speculative_max_window=8)
