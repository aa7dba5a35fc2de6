"""The q8 activation codec (protocol/activation_codec.py): golden bytes, gguf-py's Q8_0
quantizer as the reference, its error bound, what a frame refuses, the runner's conversion."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from skippy.protocol import ActivationDtype, FrameError, MessageKind, StageMessage, decode_message, encode_message
from skippy.protocol.activation_codec import q8_decode, q8_encode
from skippy.protocol.constants import MESSAGE_HEADER, Q8_BLOCK
from skippy.protocol.frames import activation_fields
from skippy.runtime.runner import rows_to_tensor, tensor_to_rows


def _block(values: list[float]) -> np.ndarray:
    return np.array(values + [0.0] * (32 - len(values)), np.float32).reshape(1, 32)


def test_golden_block():
    # max |x| = 127, so d = 1.0 (f16 0x3c00) and the codes are roundf(x): halves away from zero
    blocks = q8_encode(_block([127, -127, 0.5, -0.5, 1.49, 2.5, -2.5, 0, 126.6]))
    assert blocks.dtype == Q8_BLOCK and blocks.shape == (1, 1)
    assert blocks.tobytes().hex() == "003c" + "7f8101ff0103fd007f" + "00" * 23
    assert q8_decode(blocks)[0, :9].tolist() == [127, -127, 1, -1, 1, 3, -3, 0, 127]
    zero = q8_encode(np.zeros((1, 32), np.float32))  # d = 0: every code 0, no division by it
    assert zero.tobytes() == bytes(34) and not q8_decode(zero).any()


def test_equals_gguf_q8_0_byte_for_byte():
    rng = np.random.default_rng(0)  # heavy-tailed, as hidden states are; a zero block too
    rows = (rng.standard_normal((17, 576)) * rng.exponential(4.0, (17, 576))).astype(np.float32)
    rows[3, 64:96] = 0.0
    ours = q8_encode(rows)
    reference = quants.quantize(rows, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(ours.view(np.uint8).reshape(17, -1), reference)
    assert np.array_equal(q8_decode(ours), quants.dequantize(reference, gguf.GGMLQuantizationType.Q8_0))


def test_error_is_within_half_a_step_of_each_block():
    rng = np.random.default_rng(1)
    rows = (rng.standard_normal((8, 256)) * 30).astype(np.float32)
    rows[0, 5] = 4000.0  # one outlier: only its own block loses precision
    error = np.abs(q8_decode(q8_encode(rows)) - rows).reshape(8, 8, 32)
    step = np.abs(rows).reshape(8, 8, 32).max(axis=2) / 127
    # half a step, plus the f16 rounding of the scale (2**-11 relative) on the largest code
    assert (error.max(axis=2) <= step * (0.5 + 127 * 2**-11) + 1e-6).all()
    assert error[0, 1:].max() < error[0, 0].max() / 20  # the outlier block: a step of 4000 / 127


def test_what_q8_cannot_carry():
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_encode(np.zeros((1, 40), np.float32))
    for bad in (np.nan, np.inf, 70000.0 * 127):
        with pytest.raises(ValueError, match="finite"):
            q8_encode(_block([bad]))


def _frame(rows: np.ndarray) -> StageMessage:
    return StageMessage(MessageKind.PrefillEmbd, token_count=rows.shape[0], tokens=list(range(rows.shape[0])),
                        **activation_fields(rows, ActivationDtype.q8, 0))


def test_a_q8_frame_round_trips_and_refuses_a_bad_scale():
    blocks = q8_encode(np.random.default_rng(2).standard_normal((2, 64)).astype(np.float32))
    msg = _frame(blocks)
    assert (msg.activation_rows, msg.activation_width, msg.activation.nbytes) == (2, 64, 2 * 2 * 34)
    wire = encode_message(msg)
    decoded = decode_message(wire)
    assert decoded == msg and np.array_equal(decoded.activation_array(), blocks)
    for scale in (np.nan, np.inf, -1.0):
        bad = blocks.copy()
        bad["d"][1, 1] = scale
        with pytest.raises(FrameError, match="q8"):
            encode_message(_frame(bad))
        offset = MESSAGE_HEADER.size + 4 * 2 + 3 * 34  # the tokens, then the fourth block's scale
        forged = bytearray(wire)
        forged[offset:offset + 2] = np.array([scale], "<f2").tobytes()
        with pytest.raises(FrameError, match="q8"):
            decode_message(forged)


def test_runner_conversion():
    hidden = torch.from_numpy(np.random.default_rng(3).standard_normal((3, 64)).astype(np.float32))
    rows = tensor_to_rows(hidden, ActivationDtype.q8)
    assert np.array_equal(rows, q8_encode(hidden.numpy()))
    back = rows_to_tensor(rows, ActivationDtype.q8)
    assert back.dtype == torch.float32 and torch.equal(back, torch.from_numpy(q8_decode(rows)))


def test_auto_takes_the_widest_dtype_the_link_moves_in_its_share_of_the_compute():
    from skippy.protocol.activation_codec import auto_dtype

    mbit = 1e6 / 8
    assert auto_dtype(1, 576, 5000 * mbit, 2e-3) == ActivationDtype.f32     # loopback: nothing to save
    assert auto_dtype(1, 576, 100 * mbit, 2e-3) == ActivationDtype.f16      # 184 us in f32, 92 in f16: budget 100
    assert auto_dtype(64, 576, 100 * mbit, 25e-3) == ActivationDtype.q8     # a prompt chunk on the same link
    assert auto_dtype(64, 576, 1000 * mbit, 25e-3) == ActivationDtype.f32
    assert auto_dtype(64, 580, 100 * mbit, 25e-3) == ActivationDtype.f16    # no whole q8 blocks
