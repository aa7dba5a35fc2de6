"""Every supported architecture against transformers, from both of its file formats.

For each of llama (Llama 3 RoPE scaling), mistral (a sliding window), qwen2 (q/k/v
biases), qwen3 (q/k head norms) and gemma3 (post-norms, GeGLU, a scaled embedding,
sliding-window layers with their own RoPE base and a global layer, logit softcapping):
a tiny model with random weights built by transformers, saved by transformers as a
safetensors directory and written as llama.cpp would write its GGUF
(architecture_support.py). Our logits are within 1e-3 of transformers' float32 ones at
every position of 3 prompts (two longer than the window), 16 greedy tokens are the same,
and a 3-stage chain (sparse per-stage loads, batched decode, verify windows, prefix-cache
restores) is the one process token for token. The torch paths (no CPU kernels) and
Q8_0 blocks through our kernel are checked too, and each hyperparameter the forward
reads changes these prompts' logits (so the comparisons could catch its loss).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import gguf
import pytest
import torch

from architecture_support import (CASES, VOCAB, Case, build_reference, prompts, reference_greedy,
                                  save_hf_dir, write_gguf, write_other_gguf)
from chain_support import reference_greedy as our_greedy
from chain_support import run
from numerics import record, relative_error
from prefix_chain_support import start_cached_chain
from skippy.model import gguf_loader, layers
from skippy.model.args import LayerRange
from skippy.model.errors import ModelLoadError
from skippy.model.llama import Segment, StageModel
from skippy.model.loader import load_stage
from skippy.model.quant_linear import QuantLinear
from skippy.model.weights import needed_tensor_names
from skippy.protocol import KvCacheConfig
from skippy.runtime.speculation import SpeculativeSettings
from speculative_support import Oracle

LOGIT_TOLERANCE = 1e-3  # absolute, at every position
NUM_TOKENS = 16
SOURCES = ("hf", "gguf")
KV = KvCacheConfig(min_tokens=8, stride_tokens=16)  # prefixes of these short prompts are worth keeping


@dataclasses.dataclass
class Built:
    case: Case
    reference: torch.nn.Module
    paths: dict[str, object]  # source -> path
    prompts: list[list[int]]
    logits: list[torch.Tensor]  # transformers' [T, vocab] per prompt
    greedy: list[list[int]]  # transformers' 16 greedy tokens per prompt


@pytest.fixture(scope="module", params=list(CASES))
def built(request, tmp_path_factory) -> Built:
    case = CASES[request.param]
    directory = tmp_path_factory.mktemp(case.name)
    reference = build_reference(case)
    paths = {"hf": save_hf_dir(reference, directory / "hf"),
             "gguf": write_gguf(case, reference, directory / "model.gguf")}
    texts = prompts()
    with torch.no_grad():
        logits = [reference(torch.tensor([p])).logits[0] for p in texts]
    return Built(case, reference, paths, texts, logits, [reference_greedy(reference, p, NUM_TOKENS) for p in texts])


def all_logits(model: StageModel, prompt: list[int]) -> torch.Tensor:
    hidden = model.forward(torch.tensor(prompt), [Segment(model.new_cache(), 0, len(prompt))])
    return model.compute_logits(hidden)


def max_difference(model: StageModel, built: Built) -> float:
    return max((all_logits(model, p) - expected).abs().max().item() for p, expected in zip(built.prompts, built.logits))


@pytest.mark.parametrize("source", SOURCES)
def test_logits_match_transformers_at_every_position(built, source, request):
    model = load_stage(built.paths[source], device="cpu", progress=False)
    record(f"{request.node.callspec.id}: max |ours - transformers| logit", max_difference(model, built),
           LOGIT_TOLERANCE)


@pytest.mark.parametrize("source", SOURCES)
def test_greedy_tokens_match_transformers(built, source):
    model = load_stage(built.paths[source], device="cpu", progress=False)
    for prompt, expected in zip(built.prompts, built.greedy):
        assert our_greedy(model, prompt, NUM_TOKENS)[0] == expected


def test_torch_paths_match_transformers(built, monkeypatch):
    """Without our CPU kernels (CUDA, no C compiler): torch's norms, RoPE, attention
    (windows as masks and slices) and activations."""
    monkeypatch.setattr(layers, "_on_our_kernels", lambda x: False)
    model = load_stage(built.paths["gguf"], device="cpu", progress=False)
    record(f"{built.case.name}, torch paths: max |ours - transformers| logit", max_difference(model, built),
           LOGIT_TOLERANCE)
    for prompt, expected in zip(built.prompts, built.greedy):
        assert our_greedy(model, prompt, NUM_TOKENS)[0] == expected


def test_quantized_blocks_agree_with_their_float_values(built, tmp_path):
    """Q8_0 block matmuls through our kernel against the same weights dequantized to float32.
    With two activation levels in every matmul they differ by the float16 KV rows, mostly
    (2^-11 relative, through 3 to 6 layers: ~2e-3 observed). The default rounds most inputs
    to one int8 level, as llama.cpp does: up to 1/254 of a group's largest value each, which
    these random tiny models amplify to up to ~8% of the logits (observed). A missing bias
    or norm would be O(1) off."""
    path = write_gguf(built.case, built.reference, tmp_path / "q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    quantized = load_stage(path, device="cpu", progress=False)
    assert all(isinstance(block.wqkv, QuantLinear) for block in quantized.blocks)
    exact = load_stage(path, dtype="float32", device="cpu", progress=False)
    finer = load_stage(path, device="cpu", progress=False)
    for linear in finer.linears:
        if isinstance(linear, QuantLinear):
            linear.levels = 2
    finer.decode_layers = None  # the one call took each matmul's levels at load: the loop reads them now
    for prompt in built.prompts:
        expected = all_logits(exact, prompt)
        record(f"{built.case.name}, Q8_0 kernel, two levels, vs its float32 values: relative logit error",
               relative_error(all_logits(finer, prompt), expected), 1e-2)
        record(f"{built.case.name}, Q8_0 kernel (default levels) vs its float32 values: relative logit error",
               relative_error(all_logits(quantized, prompt), expected), 0.15)


def stage_factory(path):
    num_layers = load_stage(path, (0, 1), device="cpu", progress=False).args.num_layers

    def make(start: int = 0, end: int | None = None) -> StageModel:
        return load_stage(path, (start, end or num_layers), device="cpu", progress=False)  # the sparse load

    return make


def test_three_stage_chain_equals_one_process(built):
    """Token by token alone, three at once (batched decode steps), with verify windows (an
    oracle proposer, every third draft wrong: accepted and rejected rows) and from each
    stage's prefix cache (the whole prompt, and a shared head under another tail)."""
    make_stage = stage_factory(built.paths["gguf"])
    one_process = [our_greedy(make_stage(), p, NUM_TOKENS)[0] for p in built.prompts]
    assert one_process == built.greedy
    longest = built.prompts[-1]
    other_tail = longest[:32] + [(t + 1) % VOCAB for t in longest[32:]]  # the cache's 16-token grid: 32 restore

    async def main():
        chain = await start_cached_chain(make_stage, built.paths["gguf"], 3, KV, ctx_size=128, concurrency=3)
        try:
            for prompt, expected in zip(built.prompts, one_process):
                assert (await chain.client.generate(prompt, max_tokens=NUM_TOKENS)).tokens == expected
            together = await asyncio.gather(*(chain.client.generate(p, max_tokens=NUM_TOKENS) for p in built.prompts))
            assert [result.tokens for result in together] == one_process
            again = await chain.client.generate(longest, max_tokens=NUM_TOKENS)
            assert again.timings.restore_decision == "chain_restore_hit"
            assert again.timings.restored_tokens == len(longest) - 1 and again.tokens == one_process[-1]
            shared = await chain.client.generate(other_tail, max_tokens=NUM_TOKENS)
            assert shared.timings.restored_tokens == 32
            assert shared.tokens == our_greedy(make_stage(), other_tail, NUM_TOKENS)[0]
            Oracle.wrong_every = 3
            for prompt, expected in zip(built.prompts, one_process):
                Oracle.prompt_len, Oracle.future = len(prompt), expected
                result = await chain.client.generate(prompt, max_tokens=NUM_TOKENS,
                                                     speculative=SpeculativeSettings("test-oracle", 1, 4))
                assert result.tokens == expected
                assert 0 < result.speculation["draft_n_accepted"] < result.speculation["draft_n"]
        finally:
            Oracle.wrong_every = 0
            await chain.close()

    run(main())


def test_a_stage_reads_only_its_layers_tensors(built, monkeypatch):
    read, real_dequantize = [], gguf_loader._dequantize

    def recording(tensor, args):
        read.append(tensor.name)
        return real_dequantize(tensor, args)

    monkeypatch.setattr(gguf_loader, "_dequantize", recording)
    model = load_stage(built.paths["gguf"], (1, 2), device="cpu", progress=False)
    args = model.args
    assert read == needed_tensor_names(LayerRange(1, 2, args.num_layers), args.tie_word_embeddings, args.arch)
    assert all(name.startswith("blk.1.") for name in read) and len(read) == len(args.arch.block_tensors)


# Each row: a case, and a hyperparameter whose loss the prompts must show (else the
# comparisons above could not catch a forward that ignores it).
ABLATIONS = [
    pytest.param("llama3", {"rope_freq_factors": None}, id="llama3-rope-factors"),
    pytest.param("mistral", {"sliding_window": None}, id="mistral-window"),
    pytest.param("gemma3", {"sliding_window": None}, id="gemma3-window"),
    pytest.param("gemma3", {"sliding_rope_theta": None}, id="gemma3-local-rope"),
    pytest.param("gemma3", {"rope_freq_factors": None}, id="gemma3-global-rope-scaling"),
    pytest.param("gemma3", {"final_logit_softcapping": None}, id="gemma3-softcap"),
]


@pytest.mark.parametrize(("name", "change"), ABLATIONS)
def test_the_prompts_tell_each_hyperparameter(name, change, tmp_path):
    case = CASES[name]
    reference = build_reference(case)
    path = write_gguf(case, reference, tmp_path / "model.gguf")
    reader = gguf_loader.open_gguf(path)
    args = gguf_loader.read_model_args(reader)
    weights = gguf_loader.load_gguf_tensors(reader, args, LayerRange.full(args.num_layers), None, torch.device("cpu"))
    ablated = StageModel(dataclasses.replace(args, **change), LayerRange.full(args.num_layers), weights,
                         torch.device("cpu"))
    texts = prompts()
    with torch.no_grad():
        expected = [reference(torch.tensor([p])).logits[0] for p in texts]
    worst = max((all_logits(ablated, p) - e).abs().max().item() for p, e in zip(texts, expected))
    assert worst > 100 * LOGIT_TOLERANCE


def test_gemma_query_scalar_comes_from_the_config(tmp_path):
    """A query_pre_attn_scalar other than head_dim (the GGUF has no key for it: llama.cpp
    derives it, so only a config.json can say)."""
    case = dataclasses.replace(CASES["gemma3"], config=CASES["gemma3"].config.__class__(
        **{**CASES["gemma3"].config.to_dict(), "query_pre_attn_scalar": 40}))
    reference = build_reference(case)
    model = load_stage(save_hf_dir(reference, tmp_path / "hf"), device="cpu", progress=False)
    assert model.args.query_pre_attn_scalar == 40
    texts = prompts()
    with torch.no_grad():
        expected = [reference(torch.tensor([p])).logits[0] for p in texts]
    worst = max((all_logits(model, p) - e).abs().max().item() for p, e in zip(texts, expected))
    record("gemma3 with query_pre_attn_scalar 40: max |ours - transformers| logit", worst, LOGIT_TOLERANCE)


def test_an_unsupported_architecture_names_itself_and_the_supported_ones(tmp_path):
    with pytest.raises(ModelLoadError, match=r"general\.architecture='phi3'\. skippy supports: llama, qwen2, qwen3, "
                                             r"gemma3\. Fix:"):
        load_stage(write_other_gguf(tmp_path / "phi3.gguf", "phi3"), device="cpu", progress=False)
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "gemma2"}')
    with pytest.raises(ModelLoadError, match=r"model_type='gemma2'\. skippy supports: llama, mistral, qwen2, qwen3, "
                                             r"gemma3_text\."):
        load_stage(directory, device="cpu", progress=False)


def test_an_unsupported_rope_type_is_refused(tmp_path):
    config = CASES["llama3"].config.to_dict()
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"Unsupported RoPE type 'yarn'.*supported: default, linear, llama3"):
        load_stage(directory, device="cpu", progress=False)
