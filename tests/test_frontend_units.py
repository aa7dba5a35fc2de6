"""Frontend pieces without a server or a model: stop-string hold-back, admission, request schemas."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from skippy.api.admission import (
    Admission, AdmissionTimeout, ContextTooLong, QueueFull, check_fits, default_queue_size,
)  # fmt: skip
from skippy.api.errors import to_api_error
from skippy.api.schemas import ChatCompletionRequest, CompletionRequest
from skippy.api.streaming import StopTextStream


class PieceTokenizer:
    """Token i decodes to PIECES[i]; enough for IncrementalDecoder."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=False) -> str:
        return "".join(self.pieces[i] for i in ids)


def run_stream(pieces: list[str], stop: list[str]) -> tuple[list[str], bool]:
    stream = StopTextStream(PieceTokenizer(pieces), stop)
    sent = []
    for i in range(len(pieces)):
        sent.append(stream.push(i))
        if stream.is_stopped:
            return sent, True
    sent.append(stream.flush())
    return sent, False


@pytest.mark.parametrize(
    "pieces, stop, expected_text, expected_stopped",
    [
        (["Hello", " world", "!"], [], "Hello world!", False),  # no stop strings: everything passes
        (["Hello", " world", "!"], ["world"], "Hello ", True),  # stop inside one token
        (["The", " an", "swer", " is"], ["answer"], "The ", True),  # stop spanning three tokens
        (["a", "b", "c"], ["x", "bc"], "a", True),  # the second of two stop strings
        (["STOP", "more"], ["STOP"], "", True),  # stop at the very start: nothing at all
        (["ab", "cd"], ["cdx", "bc"], "a", True),  # earliest match wins over a longer candidate
        (["Hel", "lo"], ["lox"], "Hello", False),  # a held-back tail that never completes is released
        (["1", "2", "3"], ["23", "3"], "1", True),  # overlapping stops: the earliest start
    ],
)
def test_stop_strings(pieces, stop, expected_text, expected_stopped):
    sent, stopped = run_stream(pieces, stop)
    assert "".join(sent) == expected_text
    assert stopped == expected_stopped


def test_stop_string_never_leaks_while_streaming():
    # Every prefix that has been sent must not contain, nor end in a partial, stop string
    # that later completes: the stop text is split across every token boundary here.
    stop = "<END>"
    pieces = ["x", "<", "E", "N", "D", ">", "y"]
    stream = StopTextStream(PieceTokenizer(pieces), [stop])
    sent = ""
    for i in range(len(pieces)):
        sent += stream.push(i)
        assert "<" not in sent
        if stream.is_stopped:
            break
    assert stream.is_stopped and sent == "x"


def test_incomplete_utf8_is_held_until_whole():
    # Byte-level BPE can split a character; the decoder yields U+FFFD until it completes.
    class Bytes:
        table = [b"caf", b"\xc3", b"\xa9!"]

        def decode(self, ids, skip_special_tokens=False):
            return b"".join(self.table[i] for i in ids).decode("utf-8", errors="replace")

    stream = StopTextStream(Bytes(), ["!"])
    assert [stream.push(0), stream.push(1), stream.push(2)] == ["caf", "", "é"]
    assert stream.is_stopped


# ---- admission --------------------------------------------------------------------


@pytest.mark.parametrize("lanes, expected", [(1, 16), (2, 16), (4, 32), (32, 256), (40, 256)])
def test_default_queue_size_is_clamped(lanes, expected):
    assert default_queue_size(lanes) == expected


def test_check_fits():
    assert check_fits(10, None, 100) == 90  # no max_tokens: what the context leaves
    assert check_fits(10, 90, 100) == 90
    # OpenAI's words (LiteLLM maps them to ContextWindowExceededError)
    with pytest.raises(ContextTooLong, match=r"^This model's maximum context length is 100 tokens\. However, you "
                                             r"requested 101 tokens \(10 in the messages, 91 in the completion\)"):
        check_fits(10, 91, 100)
    with pytest.raises(ContextTooLong, match=r"requested 101 tokens \(100 in the messages, at least 1 in"):
        check_fits(100, None, 100)


def test_admission_queues_in_order_and_refuses_when_full():
    async def scenario():
        admission = Admission(max_active=1, max_queue=2, timeout_s=5)
        first = await admission.acquire()  # fast path
        order = []

        async def wait(name):
            lease = await admission.acquire()
            order.append(name)
            await asyncio.sleep(0)
            lease.release()

        waiters = [asyncio.create_task(wait("a")), asyncio.create_task(wait("b"))]
        await asyncio.sleep(0.01)
        assert admission.num_waiting == 2 and admission.num_active == 1
        with pytest.raises(QueueFull) as full:
            await admission.acquire()
        assert full.value.retry_after_s >= 1
        first.release()
        await asyncio.gather(*waiters)
        assert order == ["a", "b"]
        assert admission.num_active == 0 and admission.num_waiting == 0

    asyncio.run(scenario())


def test_admission_timeout_and_cancel_release_their_place():
    async def scenario():
        admission = Admission(max_active=1, max_queue=4, timeout_s=0.05)
        lease = await admission.acquire()
        with pytest.raises(AdmissionTimeout):
            await admission.acquire()
        cancelled = asyncio.create_task(admission.acquire())
        await asyncio.sleep(0.01)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert admission.num_waiting == 0
        lease.release()
        assert admission.num_active == 0
        async with await admission.acquire():  # the lane is free again
            assert admission.num_active == 1
        assert admission.num_active == 0

    asyncio.run(scenario())


# ---- request schemas and the error mapper -----------------------------------------


def error_for(model, body: str):
    with pytest.raises(ValidationError) as caught:
        model.model_validate_json(body)
    return to_api_error(caught.value)


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        ('{"model": "m"}', "messages", "Missing required field"),  # missing messages
        ('{"model": "m", "messages": []}', "messages", "at least 1"),  # empty conversation
        ('{"model": "m", "messages": [{"role": "robot", "content": "x"}]}', "messages[0].role", "Invalid"),
        ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3}', "temperature", "2"),
        ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 0}', "top_p", "greater than 0"),
        ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens", "1"),
        ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}', "n", "n=1"),
        ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a","b","c","d","e"]}',
         "stop", "at most 4"),
        ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 101}}',
         "logit_bias", "[-100, 100]"),
        ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "presence_penalty": -3}',
         "presence_penalty", "-2"),
    ],
)
def test_chat_validation_errors_name_the_field(body, param, fragment):
    error = error_for(ChatCompletionRequest, body)
    assert error.status == 400
    assert error.param == param
    assert fragment in error.message
    assert error.envelope()["error"]["type"] == "invalid_request_error"


def test_invalid_json_is_a_400():
    error = error_for(CompletionRequest, "{not json")
    assert error.status == 400 and "JSON" in error.message


def test_model_is_optional():
    assert ChatCompletionRequest.model_validate_json('{"messages": [{"role": "user", "content": "hi"}]}').model is None
    assert CompletionRequest.model_validate_json('{"prompt": "hi"}').model is None


def test_requests_accept_what_clients_send():
    chat = ChatCompletionRequest.model_validate_json(
        '{"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}]}],'
        ' "stop": "x", "logit_bias": {"7": -100}, "unknown_field": 1, "stream_options": {"include_usage": true}}'
    )
    assert chat.stop == ["x"] and chat.logit_bias == {7: -100.0} and chat.stream_options.include_usage
    text = CompletionRequest.model_validate_json('{"model": "m", "prompt": [[1, 2, 3]]}')
    assert text.prompt == [[1, 2, 3]]


# ---- layering (the contracts for every module: tests/test_layers.py) -------------------------


def test_importing_the_api_loads_no_torch():
    import subprocess
    import sys

    code = "import sys, skippy.api.app; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_a_streamed_piece_is_the_schema_s_own_chunk_byte_for_byte(kind):
    """PieceEvents' template around the text equals pydantic's dump of the whole chunk."""
    from pydantic_core import PydanticSerializationError

    from skippy.api.schemas import ChatCompletionChunk, ChatChunkChoice, ChatDelta, Completion, CompletionChoice
    from skippy.api.streaming import PieceEvents, sse

    def chunk(text):
        if kind == "chat":
            return ChatCompletionChunk(id="chatcmpl-1", created=7, model="m \"q\"",
                                       choices=[ChatChunkChoice(delta=ChatDelta(content=text))])
        return Completion(id="cmpl-1", created=7, model="m", choices=[CompletionChoice(text=text)])

    events = PieceEvents(chunk)
    pieces = [" dragon", "", "\"quoted\" \\ back/slash", "line\nbreak\ttab\r", "\x00\x01\x1f\x7f",
              "naïve café 東京 🐉", "\u2028\u2029", "<|im_end|>", "skippy-piece-0f6c2a"]
    for piece in pieces:
        assert events(piece) == sse(chunk(piece)), piece
    for make in (events, lambda text: sse(chunk(text))):  # a lone surrogate: pydantic's own error
        with pytest.raises(PydanticSerializationError):
            make("\ud800")
