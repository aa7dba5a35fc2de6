"""GGUF blocks kept quantized (skippy/model/quant.py) against the `gguf` package's
own dequantization, and the quantized model path end to end."""

from __future__ import annotations

import math
import os
import platform

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from numerics import record, unit_roundoff
from skippy.model import gguf_loader, qkernel
from skippy.model.llama import Segment
from skippy.model.gguf_types import K_QUANT_BLOCK_BYTES, LEGACY_BLOCK_BYTES
from skippy.model.quant import SUPPORTED, FloatWeight, GroupAffine, QuantizedTensor, from_gguf_blocks
from skippy.model.quant_linear import CODE_BITS, PackedPart, QuantLinear, deinterleave, interleave
from skippy.model.errors import RequestError
from skippy.model.sampling import RequestSampler
from skippy.protocol.sampling_config import SamplingConfig

BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q5_0: 22, Q.Q5_1: 24, Q.Q8_0: 34, Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}
BLOCK_WEIGHTS = {Q.Q4_K: 256, Q.Q5_K: 256, Q.Q6_K: 256}  # the rest: 32
# byte offsets of each block's float16 fields (scale, and min where the type has one)
F16_FIELDS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2],
              Q.Q6_K: [208]}


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


def requantization_bound(weight: GroupAffine, values: np.ndarray) -> np.ndarray:
    """Per weight, what requantize(values, bits) may cost: half a step of its float16
    scale, the float16 rounding of the group's minimum and of the range / top times the
    largest code (clipped at top = 2^bits - 1), and the float32 arithmetic of both decoders."""
    s, o = (np.repeat(a.astype(np.float64), 32, axis=1) for a in (weight.scale, weight.offset))
    u16, u32, top = unit_roundoff(torch.float16), unit_roundoff(), 2**weight.bits - 1
    return 0.5 * s + u16 * (np.abs(o) + top * s) + 4 * u32 * (np.abs(values) + np.abs(o) + top * s)


def assert_within(name: str, got: np.ndarray, expected: np.ndarray, bound: np.ndarray) -> None:
    diff = np.abs(got - expected)
    excess = np.divide(diff, bound, out=np.where(diff > 0, np.inf, 0.0), where=bound > 0)
    record(name, float(excess.max()), 1.0, worst_case=True)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda q: q.name)
def test_codes_decode_as_gguf_does(qtype):
    """Exactly, every type: its codes and its affine map per group (of 16 for Q6_K)."""
    raw = random_blocks(qtype, 48, 512)
    weight = from_gguf_blocks(raw, qtype, (48, 512))
    assert weight.codes.max() < 2**weight.bits
    expected = dequantize(raw, qtype).reshape(48, 512)
    np.testing.assert_array_equal(weight.dequantize(), expected)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda q: q.name)
def test_embedding_rows_decode_as_gguf_does(qtype):
    """An embedding's rows as a step reads them (our kernel, every type): the gguf package's
    values, bit for bit, in any order, repeated or not."""
    raw = random_blocks(qtype, 48, 512, seed=5)
    tensor = QuantizedTensor(raw, qtype, (48, 512))
    ids = torch.tensor([47, 0, 5, 5, 31])
    expected = dequantize(raw, qtype).reshape(48, 512)[ids.numpy()]
    np.testing.assert_array_equal(tensor.embed(ids).numpy(), expected)
    block_bytes = LEGACY_BLOCK_BYTES.get(qtype) or K_QUANT_BLOCK_BYTES[qtype]
    np.testing.assert_array_equal(qkernel.embed_rows(raw, block_bytes, ids, 512).numpy(), expected)
    with pytest.raises(ValueError, match="embed_rows failed"):  # the kernel refuses what it cannot read
        qkernel.embed_rows(raw, block_bytes, torch.tensor([48]), 512)


def kernel_weight_bound(weight: GroupAffine) -> np.ndarray:
    """Per weight, what storing scale and offset in float16 may cost: one rounding of each
    for Q5_K in q8 (d * sub-scale, dmin * sub-min), with float16's subnormal spacing (2^-24)
    as the floor."""
    u = unit_roundoff(torch.float16)
    codes = weight.codes.astype(np.float64)
    s, o = (np.repeat(a.astype(np.float64), 32, axis=1) for a in (weight.scale, weight.offset))
    return np.maximum(u * np.abs(s), 2.0**-25) * codes + np.maximum(u * np.abs(o), 2.0**-25)


@pytest.mark.parametrize("bits", [4, 8])
def test_float_weights_requantize_within_the_bound(bits):
    """--quantize: a checkpoint's float weights as codes over each group of 32's range."""
    values = np.random.default_rng(bits).standard_normal((32, 256)).astype(np.float32) * 0.05
    weight = FloatWeight(torch.from_numpy(values), bits).affine()
    assert weight.bits == bits and weight.codes.max() == 2**bits - 1 and weight.codes.min() == 0
    assert_within(f"int{bits} requantized float weights (fraction of the bound)", weight.dequantize().astype(np.float64),
                  values.astype(np.float64), requantization_bound(weight, values))


FORMATS = {Q.Q4_0: "q4", Q.Q4_1: "q4", Q.Q5_0: "q8", Q.Q5_1: "q8", Q.Q8_0: "q8", Q.Q4_K: "q4k", Q.Q5_K: "q8",
           Q.Q6_K: "q6k"}


def packed(raw: np.ndarray, qtype: Q, shape: tuple[int, int], levels: int = 1) -> QuantLinear:
    return QuantLinear.of_blocks([QuantizedTensor(raw, qtype, shape)], levels)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda q: q.name)
def test_kernel_weights_equal_gguf_up_to_float16_scales(qtype):
    """The kernel holds every type's numbers exactly (Q4_K and Q6_K in their own formats,
    packed in C), but Q5_K's, whose per-group scale and min are rounded to float16 once."""
    raw = random_blocks(qtype, 64, 512, seed=1)
    expected = dequantize(raw, qtype).reshape(64, 512).astype(np.float64)
    linear = packed(raw, qtype, (64, 512))
    assert linear.format == FORMATS[qtype]
    got = linear.dequantize().numpy().astype(np.float64)
    if qtype == Q.Q5_K:
        weight = from_gguf_blocks(raw, qtype, (64, 512))
        bound = kernel_weight_bound(weight) + unit_roundoff() * np.abs(expected)  # + float32 dequantization
        diff = np.abs(got - expected)
        excess = np.divide(diff, bound, out=np.where(diff > 0, np.inf, 0.0), where=bound > 0)
        record(f"{qtype.name} kernel weights vs gguf (fraction of the float16-scale bound)", float(excess.max()), 1.0,
               worst_case=True)
    else:
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_c_packing_equals_numpy_packing(qtype):
    """kernels/pack.c's layout is quant_linear.interleave's, rows taken in a given order
    (attn_q/attn_k unpermuted), byte for byte."""
    raw = random_blocks(qtype, 64, 768, seed=4)
    order = np.random.default_rng(0).permutation(64)
    part = QuantLinear.of_blocks([QuantizedTensor(raw, qtype, (64, 768), order)]).parts[0]
    weight = from_gguf_blocks(raw[order], qtype, (64, 768))
    codes = weight.codes.astype(np.int16) + (32 if qtype == Q.Q6_K else 0)
    bits = 6 if qtype == Q.Q6_K else 4
    np.testing.assert_array_equal(part.codes.numpy(), interleave(codes.astype(np.uint8), bits))
    np.testing.assert_array_equal(part.affine(768).dequantize(), weight.dequantize())


@given(st.integers(1, 4), st.integers(1, 5), st.sampled_from([4, 6, 8]), st.integers(0, 2**31))
@settings(max_examples=30, deadline=None)
def test_interleave_round_trips(blocks, groups, bits, seed):
    codes = np.random.default_rng(seed).integers(0, 2**bits, size=(16 * blocks, 32 * groups), dtype=np.uint8)
    layout = interleave(codes, bits)
    assert layout.nbytes == codes.size * bits // 8
    np.testing.assert_array_equal(deinterleave(layout, bits, codes.shape), codes)


def matmul_bound(x: np.ndarray, weight: GroupAffine, levels: int) -> np.ndarray:
    """|kernel - exact| per output [M, N], for x [M, K] and the kernel's weights.

    The kernel rounds x to int8 per group of 32 with dx = max|x| / 127: one level is
    off by at most dx * (1/2 + 256u) (the 256u from rounding 1/dx times values up to
    127). Two levels round the remainder (at most dx / 2) again with dr = dx / 128, so
    each value is off by at most dr * (1/2 + 256u) (rounding 1/dr times codes up to 64)
    plus u * dx (rounding the remainder); a zero stays zero. Every part of a weight multiplies
    the rounded x, so the error is sum_i w_i e_i. Its float32 arithmetic, worst case:
    per group one integer dot (exact, rounded once to float32) times two factors and
    the offset's product, G groups summed: within (G + 6) u of the terms."""
    u = unit_roundoff()
    m, k = x.shape
    dx = np.abs(x.reshape(m, k // 32, 32)).max(-1, keepdims=True) / 127  # [M, G, 1]
    step = dx / 128 * (0.5 + 256 * u) + u * dx if levels == 2 else dx * (0.5 + 256 * u)
    step = (step * (x.reshape(m, k // 32, 32) != 0)).reshape(m, k)
    codes_part = np.abs(np.repeat(weight.scale.astype(np.float64), weight.group, axis=1) * weight.codes)  # |s c|
    offset_part = np.abs(np.repeat(weight.offset.astype(np.float64), weight.group, axis=1))
    quantization = step @ np.abs(weight.dequantize().astype(np.float64)).T
    magnitude = (np.abs(x) + step) @ (codes_part + offset_part).T
    return quantization + (k // 32 + 6) * u * magnitude


def kernel_product(linear: QuantLinear, x: np.ndarray) -> np.ndarray:
    return linear(torch.from_numpy(x.astype(np.float32))).numpy().astype(np.float64)


def with_top_bit_flipped(linear: QuantLinear, n: int, k: int) -> QuantLinear:
    """The same matmul but for the top bit of weight [n, k]'s code."""
    part = linear.parts[0]
    bits = CODE_BITS[part.format]
    codes = deinterleave(part.codes.numpy(), bits, (linear.out_features, linear.in_features)).copy()
    codes[n, k] ^= 1 << (bits - 1)
    wrong = PackedPart(part.format, part.rows, torch.from_numpy(interleave(codes, bits)), part.scale, part.offset,
                       part.sub)
    return QuantLinear([wrong], linear.out_features, linear.in_features, levels=linear.levels)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q8_0, Q.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 21])
@pytest.mark.parametrize("levels", [1, 2])
def test_kernel_matmul_within_its_bound(qtype, rows, levels):
    raw = random_blocks(qtype, 48, 512, seed=2)
    linear = packed(raw, qtype, (48, 512), levels)
    weight = linear.affine()  # as the kernel holds it
    x = np.random.default_rng(rows).standard_normal((rows, 512)) * np.linspace(0.1, 3, 512)
    expected = x @ weight.dequantize().astype(np.float64).T
    bound = matmul_bound(x, weight, levels)
    got = kernel_product(linear, x)
    record(f"{qtype.name} kernel matmul, {rows} rows, {levels} levels (fraction of its bound)",
           float((np.abs(got - expected) / bound).max()), 1.0, worst_case=True)
    if levels == 2:  # 128x finer: a one-level bound would hide a lost second level
        assert np.abs(got - expected).max() < matmul_bound(x, weight, 1).max() / 16
    # a code's top bit flipped in one weight shows far above the bound of that output
    one_hot = np.zeros_like(x)
    one_hot[:, 100] = 127.0  # that weight alone, and exactly an int8 times a scale of 1: no rounding of x
    w = weight.dequantize().astype(np.float64)[5, 100]
    arithmetic = (512 // 32 + 4) * unit_roundoff() * 127 * (abs(w) + 2 * abs(weight.offset[5, 100 // weight.group]))
    assert np.all(np.abs(kernel_product(linear, one_hot)[:, 5] - 127 * w) <= arithmetic)
    flipped = kernel_product(with_top_bit_flipped(linear, 5, 100), one_hot)[:, 5] - kernel_product(linear, one_hot)[:, 5]
    assert np.all(np.abs(flipped) > 100 * arithmetic)


def test_kernel_rows_are_independent_of_the_row_count(quant_model):
    """Bit for bit: each input row is quantized alone and runs the same arithmetic in
    a tile of 4 rows as alone, so a session's rows compute alike in any batch."""
    linear = quant_model.blocks[0].w_gate_up
    x = torch.randn(9, linear.in_features)
    together = linear(x)
    for i in range(9):
        assert torch.equal(linear(x[i : i + 1]), together[i : i + 1])


def _cpu_has(flag: str) -> bool:
    with open("/proc/cpuinfo") as info:
        return any(line.startswith("flags") and flag in line.split() for line in info)


# the vector paths a build can take: (flags beyond FLAGS, what it reports, AMX tiles or not)
VARIANTS = {"plain": (["-mno-avx512f", "-mno-avx2"], 0, 0), "avx2": (["-mno-avx512f"], 2, 0),
            "vnni": (["-mno-amx-tile", "-mno-amx-int8"], 1, 0), "amx": ([], 1, 1)}


def runnable_variants() -> dict[str, tuple[list[str], int, int]]:
    """The VARIANTS this CPU (and OS, for AMX's tiles) can run."""
    names = ["plain"]
    if _cpu_has("avx2") and _cpu_has("fma") and _cpu_has("f16c"):
        names.append("avx2")
    if all(_cpu_has(f) for f in ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")):
        names.append("vnni")
        if _cpu_has("amx_tile") and _cpu_has("amx_int8") and qkernel.build(qkernel.FLAGS).skippy_qmatmul_amx():
            names.append("amx")
    return {name: VARIANTS[name] for name in names}


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the plain C path is the only one here")
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("levels", [1, 2])
def test_every_vector_path_agrees_with_plain_c(qtype, levels, monkeypatch):
    """The plain C, AVX2, AVX512-VNNI and AMX paths run the same arithmetic over one layout:
    each one this CPU can run, built here, lands within the same bound of the float product,
    and every row alike in a batch and alone. AMX's tiles of 16 rows (a prompt's) give the
    VNNI path's bits, so a prompt's rows equal the decode steps' that replay them."""
    raw = random_blocks(qtype, 48, 512, seed=3)
    linear = packed(raw, qtype, (48, 512), levels)
    weight = linear.affine()
    x = np.random.default_rng(0).standard_normal((150, 512))  # row chunks of 64 (and tiles of 16) and a rest
    x[2] *= 1e-3  # rows of other magnitudes share the batch
    x[20] *= 40.0
    exact = x @ weight.dequantize().astype(np.float64).T
    products = {}
    for name, (flags, path, amx) in runnable_variants().items():
        library = qkernel.build([*qkernel.FLAGS, *flags])
        assert (library.skippy_qmatmul_vector_path(), library.skippy_qmatmul_amx()) == (path, amx)
        monkeypatch.setattr(qkernel, "library", lambda library=library: library)
        products[name] = kernel_product(linear, x)
        assert np.all(np.abs(products[name] - exact) <= matmul_bound(x, weight, levels)), name
        for i in (0, 20, 149):
            assert np.array_equal(kernel_product(linear, x[i : i + 1]), products[name][i : i + 1]), name
    assert products["plain"].any()
    if "amx" in products:
        assert np.array_equal(products["amx"], products["vnni"])


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
    assert all(isinstance(linear, QuantLinear) for linear in quant_model.linears)
    # Q4_1 at its own 0.625 bytes a weight; the Q8_0 head at 1.125 (the file's 1.0625)
    assert quant_model.parameter_bytes <= 1.1 * file_bytes


@pytest.mark.parametrize("split", [1, 15, 29])
def test_quantized_split_stages_equal_one_stage(split, quant_model, make_quant_stage):
    first, second = make_quant_stage(0, split), make_quant_stage(split)
    expected = logits_of(quant_model, PROMPT, quant_model.new_cache())
    c1, c2 = first.new_cache(), second.new_cache()
    hidden = first.forward(torch.tensor(PROMPT), [Segment(c1, 0, len(PROMPT))])
    got = second.compute_logits(second.forward(hidden, [Segment(c2, 0, len(PROMPT))]))
    assert torch.equal(got, expected)  # the same kernels on the same rows


def test_quantized_batched_decode_equals_solo(quant_model):
    """Bit for bit: the kernel computes each row alike whatever the row count (see
    test_kernel_rows_are_independent_of_the_row_count), and every other op is per row
    or per session, so batched decode rows are exactly the solo ones."""
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


def test_quantized_prompt_rows_equal_decode_rows(quant_model):
    """Bit for bit: a prompt in one forward, in chunks, and token by token give the same
    logits at every position and the same KV rows, so a prompt replayed after a lost stage
    (or restored from the prefix cache) continues exactly as the decode did."""
    ids = (PROMPT * 4)[:70]
    whole = quant_model.new_cache()
    together = logits_of(quant_model, ids, whole)
    chunked, stepped = quant_model.new_cache(), quant_model.new_cache()
    in_chunks = torch.cat([logits_of(quant_model, ids[i : i + 32], chunked, i) for i in range(0, len(ids), 32)])
    one_by_one = torch.cat([logits_of(quant_model, [t], stepped, i) for i, t in enumerate(ids)])
    assert torch.equal(in_chunks, together) and torch.equal(one_by_one, together)
    n = len(ids)
    for cache in (chunked, stepped):
        assert torch.equal(cache.k[:, :, :n], whole.k[:, :, :n]) and torch.equal(cache.v[:, :, :n], whole.v[:, :, :n])


@pytest.mark.parametrize("start, sessions, crowded", [(0, 3, False), (11, 3, False), (0, 12, False), (0, 3, True)])
def test_one_call_decode_layers_equal_the_loop(start, sessions, crowded, quant_model, make_quant_stage):
    """A decode step's layers in one C call (qkernel.DecodeLayers) against forward's
    per-layer loop: bit for bit, the rows out and the KV rows written, for one session
    and for several batched at different positions (past 8 rows the team shares the
    quantizing of each matmul's input), on the first stage and on one fed hidden rows; and
    the logits the call goes on to compute on a stage with the head, against compute_logits'
    own two calls. Crowded: a team of more threads than cores, so that its threads lose
    their cores mid-matmul and the others take over the blocks they had not claimed."""
    if crowded:
        threads = torch.get_num_threads()
        torch.set_num_threads(2 * (os.cpu_count() or 1) + 1)
        try:
            test_one_call_decode_layers_equal_the_loop(start, sessions, False, quant_model, make_quant_stage)
        finally:
            torch.set_num_threads(threads)
        return
    model = quant_model if start == 0 else make_quant_stage(start)
    assert model.decode_layers is not None  # the bundled SmolLM2 is a model it runs
    assert model.layers.is_last and model.decode_layers.head is not None
    prompts = [PROMPT, PROMPT[:13], [5, 6, 7, 8, 9, 10, 11]]
    prompts += [PROMPT[i:] + [100 + i] for i in range(sessions - len(prompts))]

    def rows_of(tokens: list[int]) -> torch.Tensor:
        if start == 0:
            return torch.tensor(tokens)
        return torch.randn(len(tokens), model.args.hidden_size, generator=torch.Generator().manual_seed(sum(tokens)))

    def decode(one_call: bool) -> tuple[list[torch.Tensor], list]:
        fused = model.decode_layers
        caches = [model.new_cache() for _ in prompts]
        for p, c in zip(prompts, caches):  # short prompts (<= WINDOW_ROWS_MAX) take the one call too
            model.forward(rows_of(p), [Segment(c, 0, len(p))])
        outputs = []
        try:
            model.decode_layers = fused if one_call else None
            for step in range(3):
                tokens = [3 + step, 40 + step, 500 + step, *(1000 + 37 * i + step for i in range(sessions - 3))]
                for segments, x in [([Segment(c, c.length, 1) for c in caches], rows_of(tokens)),
                                    ([Segment(caches[0], caches[0].length, 1)], rows_of([tokens[0]]))]:
                    hidden = model.forward(x, segments)
                    outputs += [hidden, model.compute_logits(hidden)]
        finally:
            model.decode_layers = fused
        return outputs, caches

    (got, got_caches), (expected, expected_caches) = decode(True), decode(False)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    for a, b in zip(got_caches, expected_caches):
        n = a.length
        assert n == b.length and torch.equal(a.k[:, :, :n], b.k[:, :, :n]) and torch.equal(a.v[:, :, :n], b.v[:, :, :n])


@pytest.mark.parametrize("width", [2, 5, 9])
def test_verify_windows_in_the_one_call_equal_the_loop_and_decode_steps(width, quant_model):
    """A verify window's rows (one session, consecutive positions: each attends over the
    window's earlier rows) through the one C call, alone and batched beside another session's
    decode row: bit for bit the loop's rows, logits and KV rows, and the rows the same tokens
    give decoded one at a time."""
    model = quant_model
    window = [(7 * i + 3) % 500 for i in range(width)]

    def run(one_call: bool, batched: bool, stepped: bool = False):
        fused = model.decode_layers
        a, b = model.new_cache(), model.new_cache()
        model.forward(torch.tensor(PROMPT), [Segment(a, 0, len(PROMPT))])
        model.forward(torch.tensor(PROMPT[:13]), [Segment(b, 0, 13)])
        try:
            model.decode_layers = fused if one_call else None
            if stepped:
                hidden = torch.cat([model.forward(torch.tensor([t]), [Segment(a, len(PROMPT) + i, 1)])
                                    for i, t in enumerate(window)])
                return hidden, None, a
            segments = [Segment(a, len(PROMPT), width)] + ([Segment(b, 13, 1)] if batched else [])
            # batched, as a final stage's wave of several steps runs: the decode row's greedy pick
            # made in the call (greedy is per step; the window's rows are the sampler's)
            greedy = [None, ([], [])] if batched else None
            hidden = model.forward(torch.tensor(window + ([42] if batched else [])), segments, greedy)
            picks = model.step_picks(hidden)
            logits = model.compute_logits(hidden)
            if one_call and batched:
                assert picks == [None] * width + [int(logits[width].argmax())]
            return hidden[:width], logits, a
        finally:
            model.decode_layers = fused

    for batched in (False, True):
        (got, got_logits, got_cache), (expected, expected_logits, expected_cache) = run(True, batched), run(False, batched)
        n = len(PROMPT) + width
        assert torch.equal(got, expected) and torch.equal(got_logits, expected_logits)
        assert torch.equal(got_cache.k[:, :, :n], expected_cache.k[:, :, :n])
        assert torch.equal(got_cache.v[:, :, :n], expected_cache.v[:, :, :n])
    assert torch.equal(run(True, False, stepped=True)[0], got)


def test_the_one_call_refuses_picks_that_do_not_cover_every_row(quant_model):
    """One greedy entry per row, or no call: the kernel writes a pick for every row, and a
    shorter array (one a step, not a row: a window's rows) would be overrun, not refused."""
    from skippy.model import qkernel
    from skippy.model.layers import window_rows
    model = quant_model
    cache = model.new_cache()
    x = model._embed(torch.tensor([3, 4, 5])).float()
    segments = [Segment(cache, 0, 3)]
    cache.reserve(0, 3)
    rows = window_rows(segments, x)
    logits = torch.empty(3, model.decode_layers.vocab)
    with pytest.raises(ValueError, match="pick entry"):
        model.decode_layers(x, rows, *model.rope_tables[0], logits, qkernel.GreedyPicks([([], [])]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_attention_equals_a_cache_write_and_attend_rows(dtype):
    """A decode step's one-call attention (every session's KV write and attention at a
    layer) against the per-session path prompt chunks and verify windows take:
    bit for bit, caches of different capacities and lengths, a layer past the first."""
    from skippy.model.kv_cache import KVCache

    heads, kv_heads, head_dim, layers = 9, 3, 64, 2
    lengths, capacities = [0, 5, 300], [256, 256, 512]
    rng = torch.Generator().manual_seed(0)
    caches = [KVCache(layers, kv_heads, head_dim, 1024, dtype) for _ in lengths]
    for cache, length, capacity in zip(caches, lengths, capacities):
        cache.reserve(0, capacity)
        cache.k.copy_(torch.randn(cache.k.shape, generator=rng))
        cache.v.copy_(torch.randn(cache.v.shape, generator=rng))
        cache.commit(length)
    twins = [KVCache(layers, kv_heads, head_dim, 1024, dtype) for _ in lengths]
    for twin, cache in zip(twins, caches):
        twin.reserve(0, cache.capacity)
        twin.k.copy_(cache.k), twin.v.copy_(cache.v)
    qkv = torch.randn(len(lengths), heads + 2 * kv_heads, head_dim, generator=rng)
    scale = head_dim**-0.5

    rows = qkernel.DecodeRows.of([c.k for c in caches], [c.v for c in caches], lengths)
    got = qkernel.decode_attention(qkv, rows, 1, heads, kv_heads, scale)
    for i, (twin, start) in enumerate(zip(twins, lengths)):
        k, v = qkv[i, heads : heads + kv_heads, None], qkv[i, heads + kv_heads :, None]
        keys, values = twin.write(1, start, k, v)
        expected = qkernel.attend_rows(qkv[i : i + 1].contiguous(), heads, keys, values, start, scale)
        assert torch.equal(got[i], expected[0])
        assert torch.equal(caches[i].k, twin.k) and torch.equal(caches[i].v, twin.v)


COPY_PROMPT = ("Repeat the following code exactly, changing only the function name to order_total:\n\n"
               "def total_price(items, tax_rate):\n    subtotal = sum(item.price * item.quantity for item in items)\n"
               "    return round(subtotal * (1 + tax_rate), 2)")


def test_quantized_speculation_equals_token_by_token(quant_model, tokenizer):
    from skippy.runtime.local_generation import GenerationLimits, generate_tokens
    from skippy.runtime.local_speculative import generate_tokens_speculative
    from skippy.runtime.proposers import create_proposer
    from skippy.runtime.speculation import SpeculationStats

    prompt = tokenizer.encode_chat([{"role": "user", "content": COPY_PROMPT}])
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
        prompt = tokenizer.encode_chat([{"role": "user", "content": text}])
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


def test_torch_fallback_equals_our_kernels(make_stage, monkeypatch):
    """Where our kernels cannot run (CUDA, no C compiler), layers.py takes torch's ops
    for norms, RoPE, attention and SwiGLU: the float32 forward must agree within two
    evaluations' bound, prefill and decode rows alike."""
    from numerics import assert_close, forward_tolerance
    from skippy.model import layers

    model = make_stage()
    prompt, decode = PROMPT, [7, 8, 9]

    def run() -> torch.Tensor:
        cache = model.new_cache()
        rows = [logits_of(model, prompt, cache)[-1:]]
        rows += [logits_of(model, [t], cache) for t in decode]
        return torch.cat(rows)

    ours = run()
    monkeypatch.setattr(layers, "_on_our_kernels", lambda x: False)
    fallback = run()
    tolerance = forward_tolerance(model.args, layers=model.args.num_layers, positions=len(prompt) + len(decode),
                                  head=True)
    assert_close("our row kernels == torch's ops, float32 logits", ours, fallback, tolerance)


@given(st.integers(1, 300), st.sampled_from(["normal", "nan", "ties", "-inf", "inf", "zeros"]),
       st.lists(st.tuples(st.integers(0, 299), st.sampled_from([-100.0, -1.5, 0.0, 0.25, 7.0, math.inf, -math.inf])),
                max_size=5, unique_by=lambda pair: pair[0]), st.integers(0, 2**32 - 1))
@settings(max_examples=400, deadline=None)
def test_kernel_greedy_pick_is_the_samplers(n, kind, bias, seed):
    """The kernels' greedy pick (what a decode call picks as it writes the logits) is the
    sampler's: numpy's first argmax, a NaN counting as the largest, of the logits plus
    logit_bias added in float32, ties, infinities and signed zeros included; the row
    itself is left as it was."""
    rng = np.random.default_rng(seed)
    row = rng.standard_normal(n).astype(np.float32)
    if kind == "nan":
        row[rng.integers(0, n, 2)] = np.nan
    elif kind == "ties":
        row = np.round(row)
    elif kind in ("-inf", "inf"):
        row[rng.integers(0, n, 1 if kind == "inf" else n)] = float(kind)
    elif kind == "zeros":
        row[:] = 0.0
        row[rng.integers(0, n, 3)] = -0.0
    bias = {token: value for token, value in bias if token < n}
    sampler = RequestSampler(SamplingConfig(temperature=0.0, logit_bias=bias))
    ids, values = sampler.greedy_bias(n)
    x = torch.from_numpy(row.copy())
    pick = qkernel.greedy_pick(x, ids, values)
    assert np.array_equal(x.numpy(), row, equal_nan=True)
    try:
        expected = sampler.sample(torch.from_numpy(row.copy()), ())
    except RequestError:  # every token banned: the sampler refuses, and the runner refuses the pick
        assert row[pick] + bias.get(pick, 0.0) == -math.inf
        return
    assert pick == expected


def test_decode_step_picks_are_the_samplers(quant_model):
    """A decode step on the final stage picks greedy rows in the layers' call (forward's
    `greedy`, as the runner asks); each pick is its sampler's on the step's own logits,
    batched with rows that ask for none, with and without logit_bias."""
    configs = [SamplingConfig(temperature=0.0, logit_bias={2: -100.0, 0: -100.0}), None,
               SamplingConfig(temperature=0.0), SamplingConfig(temperature=0.0, logit_bias={1234: 100.0})]
    caches = [quant_model.new_cache() for _ in configs]
    for i, cache in enumerate(caches):
        logits_of(quant_model, PROMPT[i:], cache)
    for step in range(3):
        tokens = [7 + step, 70 + step, 700 + step, 4000 + step]
        greedy = [None if c is None else RequestSampler(c).greedy_bias(quant_model.args.vocab_size) for c in configs]
        hidden = quant_model.forward(torch.tensor(tokens), [Segment(c, c.length, 1) for c in caches], greedy)
        picks = quant_model.step_picks(hidden)
        logits_now = quant_model.compute_logits(hidden)
        assert picks is not None and picks[1] is None
        assert picks[3] == 1234  # its bias makes it the largest: a pick that skipped the bias differs
        for row, config in enumerate(configs):
            if config is not None:
                assert picks[row] == RequestSampler(config).sample(logits_now[row].clone(), ())
        assert quant_model.step_picks(hidden) is picks  # handed out until the next forward


def test_runner_picks_batched_greedy_rows_in_the_forward(quant_model, monkeypatch):
    """The runner has a batched decode step's greedy rows picked in the layers' call (its
    samplers then pick nothing), a lone row by its sampler: the same tokens either way."""
    from skippy.runtime.runner import Runner
    from skippy.runtime.session import Session
    from skippy.runtime.step import SampleMode, Step

    runner = Runner(quant_model, 256, record_logits=True)
    sessions = [Session(key=(1, i), request_id=i) for i in range(3)]
    for i, session in enumerate(sessions):
        runner.configure(session, SamplingConfig(temperature=0.0, logit_bias={2: -100.0} if i else {}))
        runner.run_batch([Step(session, 0, len(PROMPT) - i, tokens=PROMPT[i:], sample=SampleMode.LAST)])
    sampled = []
    monkeypatch.setattr(RequestSampler, "sample", lambda self, *a: sampled.append(a) or -1)
    for step in range(2):
        steps = [Step(s, s.cache.length, 1, tokens=[9 + step], sample=SampleMode.LAST) for s in sessions]
        results = runner.run_batch(steps)
        assert not sampled
        for s, result in zip(sessions, results):
            expected = RequestSampler(s.sampling).greedy_bias(quant_model.args.vocab_size)
            row = runner.last_logits[s.key].clone()
            assert result.tokens == [qkernel.greedy_pick(row, *expected)]
    runner.run_batch([Step(sessions[0], sessions[0].cache.length, 1, tokens=[5], sample=SampleMode.LAST)])
    assert len(sampled) == 1  # one row: its sampler's pick


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 4), (9, 3), (8, 2), (10, 2)])
@pytest.mark.parametrize("head_dim", [32, 48, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_attention_rows_equal_float64_softmax_attention(heads, kv_heads, head_dim, dtype):
    """Our attention kernel (the decode step's and a prompt's) against softmax attention in
    float64 over the same cached keys: groups of 1-5 query heads a kv head (its rows go 3 at a
    time), head sizes that split into 4-vector chunks or not, key counts with and without a
    tail of 4, causal rows."""
    rng = torch.Generator().manual_seed(heads * head_dim + kv_heads)
    start, n = 41, 6  # rows at positions 41..46: 42..47 keys each
    k = torch.randn(kv_heads, start + n, head_dim, generator=rng).to(dtype)
    v = torch.randn(kv_heads, start + n, head_dim, generator=rng).to(dtype)
    qkv = torch.randn(n, heads + 2 * kv_heads, head_dim, generator=rng)
    scale = head_dim**-0.5
    got = qkernel.attend_rows(qkv, heads, k, v, start, scale).double()
    group = heads // kv_heads
    for i in range(n):
        keys, values = k[:, : start + i + 1].double(), v[:, : start + i + 1].double()
        q = qkv[i, :heads].double().view(kv_heads, group, head_dim)
        weights = torch.softmax(q @ keys.transpose(1, 2) * scale, dim=-1)  # [kv, group, keys]
        expected = (weights @ values).reshape(heads * head_dim)
        torch.testing.assert_close(got[i], expected, rtol=0, atol=2e-6 * float(values.abs().max()))
