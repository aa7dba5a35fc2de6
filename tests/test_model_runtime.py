"""Split composition, KV-cache semantics and batched forward of StageModel."""

from __future__ import annotations

import pytest
import torch

from numerics import assert_close, forward_tolerance, relative_error
from skippy.model.errors import ContextOverflowError
from skippy.model.llama import Segment

PROMPT = list(range(300, 340))  # 40 token ids


def tolerance(model, layers: int | None = None, positions: int = len(PROMPT) + 1) -> float:
    """Two kernels' roundings of `layers` blocks (all of the model's by default) and the head."""
    args = model.args
    return forward_tolerance(args, layers=layers or args.num_layers, positions=positions, head=True)


def run(model, ids, cache, start=None):
    start = cache.length if start is None else start
    return model.forward(torch.tensor(ids), [Segment(cache, start, len(ids))])


def logits_of(model, ids, cache, start=None):
    return model.compute_logits(run(model, ids, cache, start))


def decode(model, cache, token, steps):
    out = []
    for _ in range(steps):
        token = int(logits_of(model, [token], cache)[-1].argmax())
        out.append(token)
    return out


@pytest.mark.parametrize("split", [1, 7, 15, 29])
def test_split_stages_compose_to_full_model(split, make_stage):
    full, first, second = make_stage(), make_stage(0, split), make_stage(split, 30)
    expected = logits_of(full, PROMPT, full.new_cache())
    c1, c2 = first.new_cache(), second.new_cache()
    hidden = first.forward(torch.tensor(PROMPT), [Segment(c1, 0, len(PROMPT))])
    got = second.compute_logits(second.forward(hidden, [Segment(c2, 0, len(PROMPT))]))
    assert_close(f"split at {split} == one stage, prefill logits", got, expected, tolerance(full))
    # and a decode step through both halves
    h = first.forward(torch.tensor([5]), [Segment(c1, 40, 1)])
    got = second.compute_logits(second.forward(h, [Segment(c2, 40, 1)]))
    ref_cache = full.new_cache()
    logits_of(full, PROMPT, ref_cache)
    assert_close(f"split at {split} == one stage, decode logits", got, logits_of(full, [5], ref_cache), tolerance(full))


def test_trim_then_decode_equals_fresh_run(make_stage):
    model = make_stage()
    fresh = model.new_cache()
    last = int(logits_of(model, PROMPT, fresh)[-1].argmax())
    expected = decode(model, fresh, last, 5)

    cache = model.new_cache()
    logits_of(model, PROMPT, cache)
    decode(model, cache, 77, 5)  # wander off
    cache.truncate(40)
    assert decode(model, cache, last, 5) == expected


def test_checkpoint_rollback_restores_state(make_stage):
    model = make_stage()
    cache = model.new_cache()
    last = int(logits_of(model, PROMPT, cache)[-1].argmax())
    checkpoint = cache.checkpoint()
    logits_of(model, [11, 12, 13], cache)  # a provisional verify window
    cache.rollback(checkpoint)
    assert cache.length == 40
    fresh = model.new_cache()
    logits_of(model, PROMPT, fresh)
    assert decode(model, cache, last, 4) == decode(model, fresh, last, 4)


def test_write_below_checkpoint_invalidates_it(make_stage):
    model = make_stage(0, 2)
    cache = model.new_cache()
    run(model, PROMPT, cache)
    checkpoint = cache.checkpoint()
    run(model, [1, 2], cache, start=30)
    with pytest.raises(KeyError):
        cache.rollback(checkpoint)


def test_authoritative_start_overwrites_speculative_tail(make_stage):
    model = make_stage()
    fresh = model.new_cache()
    logits_of(model, PROMPT, fresh)
    expected = logits_of(model, [9], fresh)

    cache = model.new_cache()
    logits_of(model, PROMPT + [1, 2, 3], cache)  # ahead by 3 uncommitted rows
    got = logits_of(model, [9], cache, start=40)
    assert cache.length == 41
    assert_close("authoritative start == fresh cache, decode logits", got, expected, tolerance(model))


@pytest.mark.parametrize("repack", [False, True], ids=["mkl", "repacked"])
def test_batched_forward_equals_per_session(make_stage, repack):
    # Batched and solo rows may take different kernels (row counts, or oneDNN's copy
    # for several rows and MKL for one): rule 4 of tests/numerics.py either way.
    model = make_stage()
    if repack:
        assert model.repack_for_batches() == model.repack_bytes > 0
    prompts = [PROMPT, PROMPT[:13], [5, 6, 7, 8, 9, 10, 11]]
    solo_caches = [model.new_cache() for _ in prompts]
    solo = [logits_of(model, p, c) for p, c in zip(prompts, solo_caches)]

    caches = [model.new_cache() for _ in prompts]
    ids = torch.tensor([t for p in prompts for t in p])
    batched = model.compute_logits(model.forward(ids, [Segment(c, 0, len(p)) for p, c in zip(prompts, caches)]))
    kernels = "repacked" if repack else "mkl"
    assert_close(f"batched == solo prefill logits ({kernels})", batched, torch.cat(solo), tolerance(model))
    assert batched.argmax(-1).tolist() == torch.cat(solo).argmax(-1).tolist()

    # one decode row per session, at different positions, in one call
    tokens = [3, 4, 5]
    expected = torch.cat([logits_of(model, [t], c) for t, c in zip(tokens, solo_caches)])
    got = model.compute_logits(model.forward(torch.tensor(tokens), [Segment(c, c.length, 1) for c in caches]))
    assert_close(f"batched == solo decode logits ({kernels})", got, expected, tolerance(model))
    assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()


@pytest.mark.parametrize("bug", ["position off by one", "another session's cache"])
def test_a_wrong_row_exceeds_the_bound_by_orders_of_magnitude(make_stage, bug):
    """The bound above must still catch a real bug: one decode row computed at the
    wrong position, or against the wrong session's keys, is >= 100x over it."""
    model = make_stage()
    prompts = [PROMPT, PROMPT[:13]]
    solo_caches = [model.new_cache() for _ in prompts]
    for p, c in zip(prompts, solo_caches):
        logits_of(model, p, c)
    caches = [model.new_cache() for _ in prompts]
    for p, c in zip(prompts, caches):
        logits_of(model, p, c)
    expected = torch.cat([logits_of(model, [t], c) for t, c in zip([3, 4], solo_caches)])
    if bug == "position off by one":
        segments = [Segment(caches[0], caches[0].length - 1, 1), Segment(caches[1], caches[1].length, 1)]
    else:
        segments = [Segment(caches[1], caches[1].length, 1), Segment(caches[0], caches[0].length, 1)]
    got = model.compute_logits(model.forward(torch.tensor([3, 4]), segments))
    error = relative_error(got, expected)
    assert error >= 100 * tolerance(model), f"{bug}: error {error:.3g} is within 100x of the bound"


def test_snapshot_restore_equals_original(make_stage):
    model = make_stage(0, 3)
    cache = model.new_cache()
    run(model, PROMPT, cache)
    snapshot = cache.snapshot(32)
    other = model.new_cache()
    other.restore(snapshot)
    assert other.length == 32
    assert torch.equal(run(model, PROMPT[32:], other), run(model, PROMPT[32:], cache, start=32))


def test_context_overflow_is_a_clear_error(make_stage):
    model = make_stage(0, 1)
    cache = model.new_cache(max_tokens=16)
    with pytest.raises(ContextOverflowError, match="context size is 16"):
        run(model, PROMPT, cache)
    assert cache.length == 0


def test_sparse_stages_hold_about_half_the_weights(make_stage):
    full = make_stage().parameter_bytes
    first, second = make_stage(0, 15).parameter_bytes, make_stage(15, 30).parameter_bytes
    # the tied embedding/head sits on both ends, so each half is a bit over 50%
    assert 0.4 < first / full < 0.7 and 0.4 < second / full < 0.7
    middle = make_stage(10, 20).parameter_bytes
    assert middle < first


def test_repacked_weights_change_no_result(make_stage):
    plain, repacked = make_stage(15, 30), make_stage(15, 30)
    added = repacked.repack_for_batches()
    assert added == repacked.repack_bytes >= repacked.parameter_bytes // 2
    assert repacked.parameter_bytes == plain.parameter_bytes  # the copy is not a parameter
    assert repacked.repack_for_batches() == 0  # once only
    hidden = torch.randn(len(PROMPT), plain.args.hidden_size)
    caches = plain.new_cache(), repacked.new_cache()
    prefill = [m.compute_logits(m.forward(hidden, [Segment(c, 0, len(PROMPT))]))
               for m, c in zip((plain, repacked), caches)]
    assert_close("repacked == plain prefill logits, layers [15, 30)", prefill[1], prefill[0], tolerance(plain, 15))
    assert prefill[1].argmax(-1).tolist() == prefill[0].argmax(-1).tolist()
    row = torch.randn(1, plain.args.hidden_size)  # one row keeps to the same kernel: identical
    one = [m.compute_logits(m.forward(row, [Segment(m.new_cache(), 0, 1)])) for m in (plain, repacked)]
    assert torch.equal(one[0], one[1])


def test_repack_applies_to_float32_cpu_weights_only(full_weights):
    from skippy.model.args import LayerRange
    from skippy.model.llama import StageModel

    args, weights = full_weights
    half = {name: w.half() for name, w in weights.items() if name.startswith("blk.29.") or "output" in name
            or name == "token_embd.weight"}
    model = StageModel(args, LayerRange(29, 30, 30), half, torch.device("cpu"))
    assert model.repack_bytes == 0 and model.repack_for_batches() == 0


def test_repack_is_skipped_with_a_fix_when_memory_is_short(make_stage, monkeypatch, caplog):
    from skippy.model import loader

    model = make_stage(29, 30)
    monkeypatch.setattr(loader, "available_memory_bytes", lambda: model.repack_bytes)  # copy > half of it
    with caplog.at_level("WARNING"):
        assert loader.repack_if_it_fits(model) == 0
    assert "--no-repack" in caplog.text and all(linear.batched is None for linear in model.linears)
    monkeypatch.setattr(loader, "available_memory_bytes", lambda: None)  # unknown: repack
    assert loader.repack_if_it_fits(model) == model.repack_bytes
