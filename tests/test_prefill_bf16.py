"""--prefill-precision bf16: prompts' matmuls on AMX-BF16 tiles (kernels/qmatmul_avx512.c,
skippy_qmatmul_bf16), opt-in. The kernel against a float64 product of the weights it holds,
every format; a row's bits alike in any batch on that path; the model routes only prompt rows
to it (decode steps and verify windows keep the exact integer kernels' bits); its greedy
continuation of a prompt is transformers'; where the CPU has no AMX-BF16 it stays exact."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from numerics import record, unit_roundoff
from skippy.model import qkernel
from skippy.model.llama import BF16_PREFILL_MIN_ROWS, StageModel, Segment
from skippy.model.loader import kv_dtype_for
from test_model_quant import packed, random_blocks, with_top_bit_flipped

needs_bf16 = pytest.mark.skipif(not qkernel.bf16_ready(), reason="this CPU (or OS) has no AMX-BF16 tiles")
LONG_PROMPT = ("The printing press changed how ideas moved through Europe. Before it, every book was copied by "
               "hand, which made books rare and expensive, and errors crept into every copy. Afterwards, "
               "thousands of identical pages could be made in the time one scribe needed for a few, and "
               "pamphlets, maps and letters travelled to every city. In one paragraph, explain what followed.")


def bf16_product(linear, x: np.ndarray) -> np.ndarray:
    out = qkernel.qmatmul(torch.from_numpy(x.astype(np.float32)), linear.matmul, bf16=True)
    return out.numpy().astype(np.float64)


@needs_bf16
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("levels", [1, 2])
def test_bf16_kernel_within_bfloat16_bound_of_float64(qtype, levels):
    """Each product rounds x and w to bfloat16 (2 u_bf16) and sums K of them in float32 (K u):
    the worst case, per output. M = 150: 16-row tiles in pairs, one alone, and 6 rows of
    padding; the two-level setting (ffn_down's) must not change anything on this path."""
    K = 512
    linear = packed(random_blocks(qtype, 48, K, seed=3), qtype, (48, K), levels)
    weight = linear.affine()
    w = weight.dequantize().astype(np.float64)
    magnitude = (np.abs(weight.codes.astype(np.float64).reshape(48, K // weight.group, weight.group)
                        * weight.scale[..., None]) + np.abs(weight.offset[..., None])).reshape(48, K)
    x = np.random.default_rng(0).standard_normal((150, K)) * np.linspace(0.1, 3, K)
    x[2] *= 1e-3  # rows of other magnitudes share the batch
    x[20] *= 40.0
    x = x.astype(np.float32).astype(np.float64)
    u_bf, u = unit_roundoff(torch.bfloat16), unit_roundoff()
    bound = (2 * u_bf + u_bf**2 + K * u) * (np.abs(x) @ np.abs(w).T) + 2 * u * (np.abs(x) @ magnitude.T)
    for rows in (150, BF16_PREFILL_MIN_ROWS - 1, BF16_PREFILL_MIN_ROWS + 1):  # around the model's threshold
        error = np.abs(bf16_product(linear, x[:rows]) - x[:rows] @ w.T)
        record(f"{qtype.name} bf16 kernel matmul, {levels} levels, {rows} rows (fraction of its bound)",
               float((error / bound[:rows]).max()), 1.0, worst_case=True)
        assert np.all(error <= bound[:rows])
    # each weight where the layout keeps it: one input of 1 (exact in bfloat16) reads a column of W
    one_hot = np.zeros((17, K))
    one_hot[:, 100] = 1.0
    column = bf16_product(linear, one_hot)[:, 5]
    assert np.all(np.abs(column - w[5, 100]) <= u_bf * abs(w[5, 100]) + 2 * u * magnitude[5, 100])
    flipped = bf16_product(with_top_bit_flipped(linear, 5, 100), one_hot)[:, 5]
    assert np.all(np.abs(flipped - column) > 100 * (u_bf * abs(w[5, 100]) + 2 * u * magnitude[5, 100]))


@needs_bf16
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_bf16_kernel_rows_are_the_same_bits_in_any_batch(qtype):
    """A row's result depends only on itself on this path: alone, in a partial last tile,
    in either tile of a pair, in a batch of any size (around the routing threshold too)."""
    linear = packed(random_blocks(qtype, 80, 768, seed=4), qtype, (80, 768))  # 5 blocks: a pair and a single
    x = np.random.default_rng(1).standard_normal((150, 768))
    together = bf16_product(linear, x)
    for rows in (slice(0, 1), slice(20, 21), slice(149, 150), slice(130, 150),
                 slice(0, BF16_PREFILL_MIN_ROWS - 1), slice(3, 3 + BF16_PREFILL_MIN_ROWS + 1)):
        assert np.array_equal(bf16_product(linear, x[rows]), together[rows]), rows


def test_bf16_kernel_says_when_it_cannot_run():
    """-3 where AMX-BF16 is not there (the caller stays exact), never a silent zero."""
    lib = qkernel.build([*qkernel.FLAGS, "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"])
    assert lib.skippy_qmatmul_bf16_ready() == 0
    linear = packed(random_blocks(Q.Q4_K, 16, 256), Q.Q4_K, (16, 256))
    x, y = torch.ones(1, 256), torch.zeros(1, 16)
    assert lib.skippy_qmatmul_bf16(x.data_ptr(), 1, linear.matmul, y.data_ptr(), 0) == -3


@pytest.fixture(scope="module")
def make_model(quant_weights):
    def make(precision: str) -> StageModel:
        from skippy.model.args import LayerRange

        args, weights = quant_weights
        return StageModel(args, LayerRange.full(args.num_layers), weights, torch.device("cpu"),
                          kv_dtype=kv_dtype_for(weights), prefill_precision=precision)
    return make


@pytest.fixture(scope="module")
def exact_model(make_model):
    return make_model("exact")


@pytest.fixture(scope="module")
def bf16_model(make_model):
    if not qkernel.bf16_ready():
        pytest.skip("this CPU (or OS) has no AMX-BF16 tiles")
    return make_model("bf16")


def forward_logits(model, ids: list[int], cache, start: int) -> torch.Tensor:
    return model.compute_logits(model.forward(torch.tensor(ids), [Segment(cache, start, len(ids))]))


def test_bf16_prefill_takes_only_prompt_rows(exact_model, bf16_model, tokenizer):
    """Short prompts, decode steps and verify windows keep the exact kernels' bits; a prompt of
    BF16_PREFILL_MIN_ROWS rows or more takes the bf16 path (other bits, nearly the same logits).
    The prefix cache keeps the two apart (weight_format is in its key)."""
    ids = tokenizer.encode(LONG_PROMPT)
    assert len(ids) >= BF16_PREFILL_MIN_ROWS + 8
    short = ids[:BF16_PREFILL_MIN_ROWS - 1]
    caches = [exact_model.new_cache(256), bf16_model.new_cache(256)]
    for step in ([short], [[11]], [[12]], [[13, 14, 15, 16, 17, 18, 19, 20, 21]]):  # prompt, steps, a window
        start = caches[0].length
        a, b = (forward_logits(m, step[0], c, start) for m, c in zip((exact_model, bf16_model), caches))
        assert torch.equal(a, b), len(step[0])
    a, b = (forward_logits(m, ids, m.new_cache(256), 0) for m in (exact_model, bf16_model))
    assert not torch.equal(a, b)  # the bf16 path ran
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    record("bf16 prefill argmax agreement with exact, one prompt", 1 - agree, 0.1)
    assert exact_model.weight_format + ";prefill-bf16" == bf16_model.weight_format


def test_bf16_prefill_keeps_batched_steps_and_windows_exact(exact_model, bf16_model, monkeypatch):
    """On the layer loop (Gemma's, or any model the one-call decode does not take), many
    sessions' decode rows or verify windows make forwards of BF16_PREFILL_MIN_ROWS rows and
    more: they stay on the exact kernels, as the replay of each session would compute them."""
    for model in (exact_model, bf16_model):
        monkeypatch.setattr(model, "decode_layers", None)

    def run(model, sessions: int, rows: int) -> torch.Tensor:
        caches = [model.new_cache(32) for _ in range(sessions)]
        for i, cache in enumerate(caches):  # a short prompt each
            model.forward(torch.tensor([1, 2, 3 + i]), [Segment(cache, 0, 3)])
        ids = torch.arange(rows * sessions) % 100 + 5
        return model.forward(ids, [Segment(c, 3, rows) for c in caches])

    for sessions, rows in ((BF16_PREFILL_MIN_ROWS + 2, 1), (8, 9)):  # decode steps; verify windows
        assert sessions * rows >= BF16_PREFILL_MIN_ROWS
        assert torch.equal(run(exact_model, sessions, rows), run(bf16_model, sessions, rows)), (sessions, rows)
    assert not torch.equal(run(exact_model, 4, 17), run(bf16_model, 4, 17))  # four prompts together: bf16


def test_bf16_prefill_greedy_continuation_matches_transformers(bf16_model, hf_model, tokenizer):
    """A prompt long enough for the bf16 path, then greedy decode steps (exact): the tokens
    transformers' float32 forward on the same GGUF picks."""
    ids = tokenizer.encode_chat([{"role": "user", "content": LONG_PROMPT}])
    assert len(ids) >= BF16_PREFILL_MIN_ROWS
    sequence = list(ids)
    with torch.no_grad():
        for _ in range(16):
            sequence.append(int(hf_model(torch.tensor([sequence])).logits[0, -1].argmax()))
    cache = bf16_model.new_cache(len(sequence) + 1)
    got = [int(forward_logits(bf16_model, ids, cache, 0)[-1].argmax())]
    while len(got) < 16:
        got.append(int(forward_logits(bf16_model, got[-1:], cache, cache.length)[0].argmax()))
    assert got == sequence[len(ids):]


def test_bf16_prefill_without_amx_bf16_stays_exact(make_model, exact_model, tokenizer, monkeypatch, caplog):
    monkeypatch.setattr(qkernel, "bf16_ready", lambda: False)
    with caplog.at_level(logging.WARNING, logger="skippy.model.llama"):
        model = make_model("bf16")
    assert [r.message for r in caplog.records if "prefill-precision" in r.message] == [
        "--prefill-precision bf16: no AMX-BF16 tiles here (the CPU, its OS, or SKIPPY_AMX=0); prompts stay exact"]
    assert not model.prefill_bf16 and model.weight_format == exact_model.weight_format
    ids = tokenizer.encode(LONG_PROMPT)
    assert torch.equal(forward_logits(model, ids, model.new_cache(256), 0),
                       forward_logits(exact_model, ids, exact_model.new_cache(256), 0))


def test_prefill_precision_reaches_every_stage_config(gguf_path):
    from skippy.cli import build_parser, serve_config
    from skippy.launch.local_chain import LocalChain

    config = serve_config(build_parser().parse_args(["serve", "--prefill-precision", "bf16", "--stages", "2"]))
    assert config.prefill_precision == "bf16"
    assert build_parser().parse_args(["serve"]).prefill_precision == "exact"
    chain = LocalChain(gguf_path, 2, prefill_precision="bf16")
    try:
        assert [c.prefill_precision for c in chain.configs] == ["bf16", "bf16"]
        assert chain._stage0_options["prefill_precision"] == "bf16"
    finally:
        chain._dir.cleanup()
    with pytest.raises(ValueError, match="prefill precision"):
        StageModel.__init__(object.__new__(StageModel), None, None, {}, torch.device("cpu"), prefill_precision="fp8")
