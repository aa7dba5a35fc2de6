"""The real Gemma 3 270M (Q4_K_M GGUF, from the package index) against transformers
loading the same file: its tokenizer, its chat template (the file carries none: the
family's own, chat_template.py) and its logits.

Kept light (transformers converts the GGUF in ~30-50 s; each of its reference
passes is one forward): the full figures come from bench/accuracy.py --model.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from numerics import assert_close, forward_tolerance
from skippy.model.chat_template import GEMMA3_TEMPLATE
from skippy.model.gguf_loader import open_gguf, read_model_args
from skippy.model.llama import Segment
from skippy.model.loader import load_stage
from skippy.model.locate import gemma3_270m_path
from skippy.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello, world!",
    "  leading spaces, tabs\tand 12345 digits",
    "naïve café — 日本語 🙂 \u00a0nbsp",
    "def f(x):\n    return x ** 2\n\n\n",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "trailing space and ünïcödé   ",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "  Capital of France?  "}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a colour."}],
]
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def path():
    return gemma3_270m_path()


@pytest.fixture(scope="module")
def tokenizer(path) -> Tokenizer:
    return Tokenizer.from_gguf(path)


@pytest.fixture(scope="module")
def hf_tokenizer(path):
    import transformers  # the oracle: missing, it fails the run (never a skip)
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def hf_model(path):
    import transformers  # the oracle: missing, it fails the run (never a skip)
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def test_the_file_is_what_this_module_tests(path):
    """Gemma 3 of 18 layers, sliding and global layers both, K-quant blocks, and no chat template."""
    reader = open_gguf(path)
    args = read_model_args(reader)
    assert args.architecture == "gemma3" and args.num_layers == 18
    assert 0 < len(args.sliding_layers) < args.num_layers and args.sliding_window == 512
    assert {Q(t.tensor_type) for t in reader.tensors} >= {Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0}
    assert "tokenizer.chat_template" not in reader.fields


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(text, tokenizer, hf_tokenizer):
    ids = hf_tokenizer(text).input_ids
    assert tokenizer.encode(text) == ids
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids)
    assert tokenizer.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["user", "system", "turns"])
def test_chat_template_renders_as_transformers(conversation, add_generation_prompt, tokenizer, hf_tokenizer):
    assert tokenizer.chat_template == GEMMA3_TEMPLATE
    expected = hf_tokenizer.apply_chat_template(conversation, chat_template=GEMMA3_TEMPLATE, tokenize=False,
                                                add_generation_prompt=add_generation_prompt)
    assert tokenizer.apply_chat_template(conversation, add_generation_prompt) == expected
    expected_ids = hf_tokenizer.apply_chat_template(conversation, chat_template=GEMMA3_TEMPLATE,
                                                    add_generation_prompt=add_generation_prompt)["input_ids"]
    assert tokenizer.encode_chat(conversation, add_generation_prompt) == expected_ids  # one BOS: the template's


def greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    cache = model.new_cache(len(prompt) + num_tokens)
    hidden = model.forward(torch.tensor(prompt), [Segment(cache, 0, len(prompt))])
    out = [int(model.compute_logits(hidden[-1:]).argmax())]
    while len(out) < num_tokens:
        hidden = model.forward(torch.tensor(out[-1:]), [Segment(cache, cache.length, 1)])
        out.append(int(model.compute_logits(hidden).argmax()))
    return out


def all_logits(model, ids: list[int]) -> torch.Tensor:
    return model.compute_logits(model.forward(torch.tensor(ids), [Segment(model.new_cache(len(ids)), 0, len(ids))]))


def test_logits_and_greedy_tokens_match_transformers(path, tokenizer, hf_model):
    """Dequantized (--dtype float32, the numbers transformers computes with): logits within
    the rounding bound at every position, and transformers' argmax after every prefix of our
    greedy continuation is our next token, so its greedy output is ours. The default
    quantized path (Q4_K and Q6_K in their own formats, Q5_0 and Q8_0 at 8 bits): teacher-forced on the
    same sequences, its argmax is transformers' at nearly every position."""
    exact = load_stage(path, dtype="float32", device="cpu", progress=False)
    quantized = load_stage(path, device="cpu", progress=False)
    assert quantized.weight_format == "q4k+q4kx2+q6kx2+q8"  # x2: the down projections round inputs in two levels
    matches = total = 0
    for prompt in (tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS):
        continuation = greedy(exact, prompt, NUM_TOKENS)
        ids = prompt + continuation
        with torch.no_grad():
            expected = hf_model(torch.tensor([ids[:-1]])).logits[0]
        assert expected[len(prompt) - 1 :].argmax(-1).tolist() == continuation
        bound = forward_tolerance(exact.args, layers=exact.args.num_layers, positions=len(ids), head=True,
                                  rope_angles=True)
        assert_close("gemma3 270M, ours float32 == transformers on the GGUF, logits", all_logits(exact, ids[:-1]),
                     expected, bound)
        agree = all_logits(quantized, ids[:-1]).argmax(-1) == expected.argmax(-1)
        matches, total = matches + int(agree.sum()), total + len(agree)
    print(f"gemma3 270M quantized: teacher-forced argmax agreement {matches / total:.2%} ({matches}/{total})")
    assert matches / total >= 0.95
