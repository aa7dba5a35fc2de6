"""GGUF blocks kept quantized (skippy/model/quant.py) against the `gguf` package's
own dequantization, and the quantized model path end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from numerics import record, unit_roundoff
from skippy.model import gguf_loader
from skippy.model.llama import Segment
from skippy.model.quant import SUPPORTED, GroupAffine, Int4Linear, QuantizedTensor, from_gguf_blocks

BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q5_0: 22, Q.Q5_1: 24, Q.Q8_0: 34, Q.Q4_K: 144, Q.Q5_K: 176}
BLOCK_WEIGHTS = {Q.Q4_K: 256, Q.Q5_K: 256}  # the rest: 32
# byte offsets of each block's float16 fields (scale, and min where the type has one)
F16_FIELDS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2]}


def random_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Every bit of every block random, but the float16 scales finite and model-sized."""
    rng = np.random.default_rng(seed)
    per_block, weights = BLOCK_BYTES[qtype], BLOCK_WEIGHTS.get(qtype, 32)
    raw = rng.integers(0, 256, size=(rows, cols // weights, per_block), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        scales = (rng.standard_normal((rows, cols // weights)) * 0.01).astype(np.float16)
        raw[..., at : at + 2] = scales.view(np.uint8).reshape(rows, cols // weights, 2)
    return raw.reshape(rows, -1)


def test_every_supported_type_has_a_test_layout():
    assert set(SUPPORTED) == set(BLOCK_BYTES)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda q: q.name)
def test_codes_decode_exactly_as_gguf_does(qtype):
    raw = random_blocks(qtype, 48, 512)
    weight = from_gguf_blocks(raw, qtype, (48, 512))
    assert weight.codes.max() < 2**weight.bits
    np.testing.assert_array_equal(weight.dequantize(), dequantize(raw, qtype).reshape(48, 512))


def packed_bound(weight: GroupAffine) -> np.ndarray:
    """Per weight: each plane's scale and zero round to bfloat16 (u each), and so does
    each plane's output of the identity matmul (Int4Linear.dequantize). For an 8-bit
    code that is up to 0.5 of its quantization step (128 * 2^-9 on each of two
    planes): bfloat16 scales cost 8-bit types a relative 2^-9 per weight."""
    u = unit_roundoff(torch.bfloat16)
    bound = np.zeros(weight.shape, dtype=np.float64)
    n, k = weight.shape
    for codes, scale, zero in weight.planes():
        s, z = (np.repeat(a.astype(np.float64), 32, axis=1) for a in (scale, zero))
        bound += 2.01 * u * (np.abs(codes.astype(np.float64) - 8) * np.abs(s) + np.abs(z))
    return bound


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda q: q.name)
def test_packed_weights_equal_gguf_up_to_bfloat16_scales(qtype):
    raw = random_blocks(qtype, 64, 512, seed=1)
    weight = from_gguf_blocks(raw, qtype, (64, 512))
    expected = dequantize(raw, qtype).reshape(64, 512).astype(np.float64)
    got = Int4Linear.of(weight).dequantize().numpy().astype(np.float64)
    bound = packed_bound(weight) + unit_roundoff() * np.abs(expected)  # + the kernel's float32 arithmetic
    diff = np.abs(got - expected)
    excess = np.divide(diff, bound, out=np.where(diff > 0, np.inf, 0.0), where=bound > 0)
    record(f"{qtype.name} packed weights vs gguf (fraction of the bfloat16 bound)", float(excess.max()), 1.0,
           worst_case=True)
    assert len(weight.planes()) == (1 if weight.bits <= 4 else 2)
    # and the bound still sees a code's top bit flipped (8 steps of a 4-bit code, 128 of an 8-bit one)
    weight.codes[0, 0] ^= 1 << (weight.bits - 1)
    wrong = Int4Linear.of(weight).dequantize().numpy().astype(np.float64)
    assert abs(wrong[0, 0] - expected[0, 0]) > 4 * bound[0, 0]


@pytest.fixture(scope="module")
def reader(gguf_path):
    return gguf_loader.open_gguf(gguf_path)


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.7.attn_k.weight", "blk.3.ffn_down.weight",
                                  "token_embd.weight"])
def test_real_blocks_of_the_bundled_model_decode_as_gguf(name, reader):
    args = gguf_loader.read_model_args(reader)
    tensor = next(t for t in reader.tensors if t.name == name)
    quantized = gguf_loader._read(tensor, args, None, torch.device("cpu"))
    assert isinstance(quantized, QuantizedTensor) and quantized.qtype in (Q.Q4_1, Q.Q8_0)
    expected = gguf_loader._dequantize(tensor, args)  # the gguf package, rows unpermuted
    if name == "token_embd.weight":  # 49152 rows: a few of them, as the embedding reads them
        ids = torch.tensor([0, 1, 2, 9690, 49151])
        np.testing.assert_array_equal(quantized.embed(ids).numpy(), expected[ids.numpy()])
    else:
        np.testing.assert_array_equal(quantized.affine().dequantize(), expected)


# --- the quantized model ------------------------------------------------------------

PROMPT = list(range(300, 340))


@pytest.fixture(scope="module")
def quant_model(make_quant_stage):
    return make_quant_stage()


def logits_of(model, ids, cache, start=None):
    start = cache.length if start is None else start
    return model.compute_logits(model.forward(torch.tensor(ids), [Segment(cache, start, len(ids))]))


def test_quantized_stage_holds_about_the_file_size(quant_model, reader):
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    assert all(isinstance(linear, Int4Linear) for linear in quant_model.linears)
    # the Q8_0 head takes two 4-bit planes (1.25 bytes a weight vs the file's 1.06)
    assert quant_model.parameter_bytes <= 1.2 * file_bytes


@pytest.mark.parametrize("split", [1, 15, 29])
def test_quantized_split_stages_equal_one_stage(split, quant_model, make_quant_stage):
    first, second = make_quant_stage(0, split), make_quant_stage(split)
    expected = logits_of(quant_model, PROMPT, quant_model.new_cache())
    c1, c2 = first.new_cache(), second.new_cache()
    hidden = first.forward(torch.tensor(PROMPT), [Segment(c1, 0, len(PROMPT))])
    got = second.compute_logits(second.forward(hidden, [Segment(c2, 0, len(PROMPT))]))
    assert torch.equal(got, expected)  # the same kernels on the same rows


def test_quantized_batched_decode_equals_solo(quant_model):
    """Bit for bit: torch's int4 kernel computes each row alike whatever the row count
    (checked on its default, AVX2 and AVX-512 paths), and every other op is per row or
    per session, so batched decode rows are exactly the solo ones."""
    prompts = [PROMPT, PROMPT[:13], [5, 6, 7, 8, 9, 10, 11]]
    solo_caches = [quant_model.new_cache() for _ in prompts]
    for p, c in zip(prompts, solo_caches):
        logits_of(quant_model, p, c)
    caches = [quant_model.new_cache() for _ in prompts]
    ids = torch.tensor([t for p in prompts for t in p])
    quant_model.forward(ids, [Segment(c, 0, len(p)) for p, c in zip(prompts, caches)])
    for step in range(4):
        tokens = [3 + step, 4 + step, 5 + step]
        expected = torch.cat([logits_of(quant_model, [t], c) for t, c in zip(tokens, solo_caches)])
        segments = [Segment(c, c.length, 1) for c in caches]
        got = quant_model.compute_logits(quant_model.forward(torch.tensor(tokens), segments))
        assert torch.equal(got, expected)


COPY_PROMPT = ("Repeat the following code exactly, changing only the function name to order_total:\n\n"
               "def total_price(items, tax_rate):\n    subtotal = sum(item.price * item.quantity for item in items)\n"
               "    return round(subtotal * (1 + tax_rate), 2)")


def test_quantized_speculation_equals_token_by_token(quant_model, tokenizer):
    from skippy.runtime.local_generation import GenerationLimits, generate_tokens
    from skippy.runtime.local_speculative import generate_tokens_speculative
    from skippy.runtime.proposers import create_proposer
    from skippy.runtime.speculation import SpeculationStats

    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": COPY_PROMPT}]))
    limits = GenerationLimits(48, tokenizer.eog_ids)
    expected = list(generate_tokens(quant_model, prompt, limits))
    stats = SpeculationStats()
    got = list(generate_tokens_speculative(quant_model, prompt, limits, create_proposer("ngram-suffix"), stats=stats))
    assert got == expected
    assert stats.num_accepted_tokens > 0  # verify windows (several rows a forward) really ran


def test_quantized_argmax_agrees_with_float32_teacher_forced(quant_model, make_stage, tokenizer):
    """The quantized model reads float32's own greedy continuations; its argmax must
    agree at nearly every position (bench/accuracy.py compares both with transformers
    and llama.cpp)."""
    prompts = ["What is the capital of France?", "Explain in one sentence why the sky is blue.",
               "Write a Python function that returns the n-th Fibonacci number."]
    reference = make_stage()
    matches = total = 0
    for text in prompts:
        prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        cache, tokens = reference.new_cache(), []
        logits = logits_of(reference, prompt, cache)[-1:]
        while len(tokens) < 64:
            tokens.append(int(logits.argmax()))
            logits = logits_of(reference, tokens[-1:], cache)
        predicted = logits_of(quant_model, prompt + tokens[:-1], quant_model.new_cache())[len(prompt) - 1 :]
        matches += int((predicted.argmax(-1) == torch.tensor(tokens)).sum())
        total += len(tokens)
    disagreement = 1 - matches / total
    record("quantized argmax disagreement with float32, teacher-forced", disagreement, 0.10)
