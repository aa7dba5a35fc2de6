"""The prefix cache's disk tier through `skippy serve` (2 stages): a restart finds the entries
again, a corrupt file is quarantined and the request still answers right (spec §4.6)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from frontend_support import ServeProcess
from prefix_chain_support import system_text
from skippy.runtime.disk_cache import QUARANTINE_DIR, read_entry

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


def complete(url: str, prompt: list[int]) -> tuple[list[int], int]:
    """(completion token ids, usage cached_tokens) of one greedy /v1/completions request."""
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "return_token_ids": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text
    data = response.json()
    cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert data["timings"]["cache_n"] == cached
    assert data["timings"]["prompt_n"] == len(prompt) - cached  # the suffix prefilled
    return data["choices"][0]["token_ids"], cached


def entry_files(stage_dir: Path) -> dict[int, Path]:
    """{num_tokens: file} of one stage's disk tier."""
    return {read_entry(path).num_tokens: path for path in stage_dir.glob("*.kv")}


def metric(text: str, name: str, stage: str) -> float:
    match = re.search(rf'^{name}\{{stage="{stage}"\}} (\S+)$', text, re.MULTILINE)
    assert match, f"{name} for {stage} not in /metrics"
    return float(match.group(1))


def test_restart_finds_the_prefix_on_disk_and_a_corrupt_file_is_quarantined(tmp_path, tokenizer):
    disk = tmp_path / "kv"
    args = ["--kv-disk-dir", str(disk), "--kv-disk-budget", "1GiB", "--ctx-size", "2048"]
    system = system_text(12)
    prompt_a = tokenizer.encode(system + " Question: what does rule 4 ask for?")
    prompt_b = tokenizer.encode(system + " Question: which rule names the cedar checklist?")

    first = ServeProcess(args, tmp_path / "serve-1.log")
    try:
        tokens_a, cached = complete(first.url, prompt_a)
        assert cached == 0
        tokens_b, cached = complete(first.url, prompt_b)
        assert cached > 0  # the shared system prompt, restored in memory
    finally:
        assert first.stop() == 0
    # a clean stop wrote what memory held, each stage into its own subdirectory
    stage0, stage1 = entry_files(disk / "stage-0"), entry_files(disk / "stage-1")
    assert len(prompt_a) - 1 in stage0 and len(prompt_a) - 1 in stage1
    assert len(prompt_b) - 1 in stage1
    corrupt = stage1[len(prompt_b) - 1]
    data = bytearray(corrupt.read_bytes())
    data[-5] ^= 0xFF  # one flipped payload byte: only the checksum can tell
    corrupt.write_bytes(bytes(data))

    second = ServeProcess(args, tmp_path / "serve-2.log")
    try:
        restarted_a, cached = complete(second.url, prompt_a)
        assert cached == len(prompt_a) - 1  # every stage found its entry on disk
        assert restarted_a == tokens_a
        restarted_b, cached = complete(second.url, prompt_b)
        assert cached == 0  # stage 1's file failed its checksum: the chain prefilled cold
        assert restarted_b == tokens_b
        assert not corrupt.exists()
        assert len(list((disk / "stage-1" / QUARANTINE_DIR).iterdir())) == 1
        text = httpx.get(second.url + "/metrics").text
        assert metric(text, "skippy_prefix_cache_chain_restore_hits_total", "stage-1") == 1
        assert metric(text, "skippy_prefix_cache_chain_restore_misses_total", "stage-1") == 1
        assert metric(text, "skippy_prefix_cache_chain_restore_hits_total", "stage-0") == 2
        assert metric(text, "skippy_prefix_cache_disk_hits_total", "stage-0") == 2
        assert metric(text, "skippy_prefix_cache_evictions_total", "stage-0") == 0
        assert "skippy_prefix_cache_num_bytes" in text
    finally:
        assert second.stop() == 0
