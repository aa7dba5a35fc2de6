"""Loading: a Hugging Face directory against the GGUF it was written from, the
sparse-load rule, and the errors a bad model path gives.

The directory holds the session's dequantized float32 weights, so both paths
load the same numbers and run the same code; only the matmul kernels, which BLAS
may pick by memory alignment, can round differently (tests/numerics.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from numerics import assert_close, forward_tolerance
from skippy.model import gguf_loader, hf_loader
from skippy.model.args import LayerRange, ModelArgs
from skippy.model.errors import ModelLoadError
from skippy.model.gguf_file import GGUFFile
from skippy.model.hf_loader import hf_name
from skippy.model.llama import Segment, StageModel
from skippy.model.loader import load_stage
from skippy.model.tokenizer import Tokenizer
from skippy.model.weights import BLOCK_TENSORS, needed_tensor_names

PROMPT = "Explain in one sentence why the sky is blue."
NUM_SHARDS = 2  # more than one, so the loader's multi-file lookup is exercised
TOKENIZER_TEXTS = [
    "Hello, world!",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces, tabs\tand 12345 digits",
    "naïve café — 日本語 🙂",
    "def f(x):\n    return x ** 2\n",
]


# --- a Hugging Face llama directory written from GGUF-named float32 weights ---


def hf_config(args: ModelArgs, tokenizer: Tokenizer) -> dict:
    assert args.rope_freq_factors is None  # SmolLM2's RoPE is unscaled
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.context_length,
        "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "torch_dtype": "float32",
    }


def tokenizer_config(args: ModelArgs, tokenizer: Tokenizer) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.decode([tokenizer.bos_id]),
        "eos_token": tokenizer.decode([tokenizer.eos_id]),
        "add_bos_token": tokenizer.add_bos,
        "chat_template": tokenizer.chat_template,
        "model_max_length": args.context_length,
    }


def write_hf_checkpoint(
    args: ModelArgs, weights: dict[str, torch.Tensor], tokenizer: Tokenizer, directory: Path, num_shards: int
) -> Path:
    """Write config.json, `num_shards` safetensors files with their index, and the tokenizer files."""
    names = list(weights)
    per_shard = -(-len(names) // num_shards)
    shard_names = [names[i : i + per_shard] for i in range(0, len(names), per_shard)]
    weight_map = {}
    for index, chunk in enumerate(shard_names, start=1):
        file_name = f"model-{index:05d}-of-{num_shards:05d}.safetensors"
        save_file({hf_name(n): weights[n].contiguous() for n in chunk}, str(directory / file_name))
        weight_map.update({hf_name(n): file_name for n in chunk})
    total_size = sum(t.nbytes for t in weights.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(hf_config(args, tokenizer), indent=2))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(args, tokenizer), indent=2))
    # Tokenizer has no public save; its backend is a `tokenizers.Tokenizer`, whose
    # own serialisation is what a Hugging Face tokenizer.json is.
    tokenizer._backend.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, full_weights, tokenizer) -> Path:
    args, weights = full_weights
    return write_hf_checkpoint(args, weights, tokenizer, tmp_path_factory.mktemp("smollm2-hf"), NUM_SHARDS)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": PROMPT}])


def run(model: StageModel, x: torch.Tensor) -> torch.Tensor:
    return model.forward(x, [Segment(model.new_cache(x.shape[0]), 0, x.shape[0])])


@pytest.fixture(scope="module")
def gguf_logits(make_stage, prompt_ids) -> torch.Tensor:
    """[T, vocab] logits of the GGUF-loaded model on the prompt: the reference here."""
    model = make_stage()
    return model.compute_logits(run(model, torch.tensor(prompt_ids)))


def bound(args: ModelArgs, num_tokens: int, layers: int | None = None, *, rope_angles: bool = False) -> float:
    """Two kernels' roundings of `layers` blocks (all and the head by default)."""
    return forward_tolerance(args, layers=layers or args.num_layers, positions=num_tokens,
                             head=layers is None, rope_angles=rope_angles)


# --- the Hugging Face path against the GGUF path ---


def test_checkpoint_is_split_across_files(hf_dir):
    assert len(sorted(hf_dir.glob("*.safetensors"))) == NUM_SHARDS
    weight_map = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    # the [10, 20) stage below reads from both files
    first, last = (weight_map[hf_name(f"blk.{i}.attn_q.weight")] for i in (10, 19))
    assert first != last


def test_hf_dir_logits_equal_gguf(hf_dir, full_weights, prompt_ids, gguf_logits):
    model = load_stage(hf_dir, device="cpu", progress=False)
    assert model.args == full_weights[0]
    got = model.compute_logits(run(model, torch.tensor(prompt_ids)))
    assert_close("HF directory == GGUF logits", got, gguf_logits, bound(model.args, len(prompt_ids)))


@pytest.mark.parametrize(("quantize", "bits", "min_agreement"), [("int8", 8, 0.9), ("int4", 4, 0.85)])
def test_hf_dir_quantized_on_request(hf_dir, gguf_logits, prompt_ids, quantize, bits, min_agreement):
    """--quantize: a checkpoint's matmul weights (the tied head too) as `bits`-bit codes
    through our kernel, norms and the embedding as stored. These weights are the bundled
    Q4_1 model's, which a 4-bit grid over each group's range holds again only where a group
    used its whole range (elsewhere the new grid is finer and rounds them), so int4 moves
    the logits more than int8 does. Of these 40 prompt positions, with most inputs rounded
    to one int8 level (llama.cpp's rounding), int8 keeps the float model's argmax at 39,
    int4 at 37 on AVX2 and 35 on AVX512-VNNI (the paths sum in different orders; the
    GGUF's own 4-bit codes agree at all 40). The flips are at small margins (0.08-1.2
    logits), where the float model's choice is still our second or third: a broken
    kernel or layout misses far more often, and far down the ranking."""
    model = load_stage(hf_dir, dtype=quantize, device="cpu", progress=False)
    assert {getattr(linear, "bits", None) for linear in model.linears} == {bits}
    assert model.embedding.dtype == torch.float32 and model.kv_dtype == torch.float16
    weights = sum(linear.out_features * linear.in_features for linear in model.linears)
    held = sum(t.nbytes for linear in model.linears for t in linear.tensors)
    assert held == weights * (bits / 8 + 4 / 32)  # the codes, and a float16 scale and offset per 32
    got = model.compute_logits(run(model, torch.tensor(prompt_ids)))
    expected = gguf_logits.argmax(-1)
    assert (got.argmax(-1) == expected).float().mean() >= min_agreement
    assert (got.topk(3, -1).indices == expected[:, None]).any(-1).all()  # never far off


def test_quantize_refuses_a_gguf(gguf_path):
    with pytest.raises(ValueError, match=r"--quantize int4 is for Hugging Face checkpoints.*Fix: drop --quantize"):
        load_stage(gguf_path, (0, 1), dtype="int4", device="cpu", progress=False)


def test_hf_dir_middle_stage_equals_gguf(hf_dir, make_stage, prompt_ids):
    hidden = run(make_stage(0, 10), torch.tensor(prompt_ids))  # [T, D] activations entering layer 10
    gguf_stage = make_stage(10, 20)
    hf_stage = load_stage(hf_dir, (10, 20), device="cpu", progress=False)
    assert hf_stage.embedding is None and not hf_stage.layers.is_last
    assert_close("HF directory == GGUF, layers [10, 20) hidden", run(hf_stage, hidden), run(gguf_stage, hidden),
                 bound(hf_stage.args, len(prompt_ids), layers=10))


def record_hf_reads(monkeypatch) -> list[str]:
    """Names read with get_tensor from any safetensors file, in order."""
    read, real_safe_open = [], safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self._file = real_safe_open(*args, **kwargs)

        def __enter__(self):
            self._handle = self._file.__enter__()
            return self

        def __exit__(self, *exc):
            return self._file.__exit__(*exc)

        def keys(self):
            return self._handle.keys()

        def get_tensor(self, name):
            read.append(name)
            return self._handle.get_tensor(name)

    monkeypatch.setattr(hf_loader, "safe_open", Recording)
    return read


def record_gguf_reads(monkeypatch) -> list[str]:
    """Names of the GGUF tensors dequantized, in order."""
    read, real_dequantize = [], gguf_loader._dequantize

    def recording(tensor, args):
        read.append(tensor.name)
        return real_dequantize(tensor, args)

    monkeypatch.setattr(gguf_loader, "_dequantize", recording)
    return read


@pytest.mark.parametrize("source", ["gguf", "hf"])
def test_sparse_first_half_reads_only_its_tensors(source, hf_dir, gguf_path, full_weights, monkeypatch):
    args, weights = full_weights
    needed = needed_tensor_names(LayerRange(0, 15, args.num_layers), args.tie_word_embeddings)
    # the rule, counted by hand: the embedding and 15 blocks; no output norm or head
    assert needed == ["token_embd.weight"] + [f"blk.{i}.{t}.weight" for i in range(15) for t in BLOCK_TENSORS]
    if source == "hf":
        read, path, expected_reads = record_hf_reads(monkeypatch), hf_dir, [hf_name(n) for n in needed]
    else:
        read, path, expected_reads = record_gguf_reads(monkeypatch), gguf_path, needed
    model = load_stage(path, (0, 15), dtype="float32", device="cpu", progress=False)
    assert read == expected_reads
    assert model.parameter_bytes == sum(weights[n].nbytes for n in needed)
    assert model.parameter_bytes < 0.7 * sum(t.nbytes for t in weights.values())


@pytest.mark.slow
def test_transformers_loads_the_same_directory(hf_dir, full_weights, prompt_ids, gguf_logits):
    import transformers  # the oracle: missing, it fails the run (never a skip)
    started = time.perf_counter()
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    print(f"transformers loaded {hf_dir.name} in {time.perf_counter() - started:.1f} s")
    with torch.no_grad():
        expected = reference(torch.tensor([prompt_ids])).logits[0]
    assert_close("transformers on the HF directory == ours, logits", gguf_logits, expected,
                 bound(full_weights[0], len(prompt_ids), rope_angles=True))


@pytest.mark.parametrize("text", TOKENIZER_TEXTS)
def test_tokenizer_from_hf_dir_matches_gguf(text, hf_dir, tokenizer):
    from_dir = Tokenizer.from_hf_dir(hf_dir)
    assert from_dir.encode(text) == tokenizer.encode(text)
    assert from_dir.decode(tokenizer.encode(text)) == text


def test_tokenizer_config_round_trips(hf_dir, tokenizer):
    from_dir = Tokenizer.from_hf_dir(hf_dir)
    special = (from_dir.bos_id, from_dir.eos_id, from_dir.add_bos, from_dir.eog_ids)
    assert special == (tokenizer.bos_id, tokenizer.eos_id, tokenizer.add_bos, tokenizer.eog_ids)
    messages = [{"role": "user", "content": PROMPT}]
    assert from_dir.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)


# --- errors: each names its cause ---

TINY = {"block_count": 1, "embedding_length": 32, "vocab_size": 32}


def write_tiny_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]) -> Path:
    """A one-block GGUF with the metadata read_model_args needs and the given raw tensors."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(TINY["block_count"])
    writer.add_context_length(64)
    writer.add_embedding_length(TINY["embedding_length"])
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(TINY["vocab_size"])
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def q8_1_embedding() -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    # one 32-element block per row; gguf has no dequantizer for Q8_1
    block_elements, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    rows = TINY["vocab_size"]
    assert TINY["embedding_length"] == block_elements
    return np.zeros((rows, block_bytes), dtype=np.uint8), gguf.GGMLQuantizationType.Q8_1


def write_hf_dir(directory: Path, config: dict, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(directory / "model.safetensors"))
    return directory


TINY_HF_CONFIG = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "vocab_size": 32, "tie_word_embeddings": True,
}  # fmt: skip

def truncated_copy(source: Path, path: Path, size: int) -> Path:
    path.write_bytes(source.read_bytes()[:size])
    return path


def write_junk(path: Path) -> Path:
    path.write_bytes(b"not a gguf file" * 4)
    return path


# Each row: how to make the path (given a tmp dir and the real GGUF), the layers
# to ask for, the exception type, and a regex its message must match.
LOAD_ERRORS = [
    # a path that does not exist
    pytest.param(
        lambda tmp, real: tmp / "absent.gguf",
        None, ModelLoadError, r"Model not found: .*absent\.gguf", id="missing-file",
    ),
    # a directory that is not a Hugging Face checkpoint
    pytest.param(lambda tmp, real: tmp, None, ModelLoadError, r"has no config\.json", id="dir-without-config"),
    # a file that is not GGUF at all
    pytest.param(
        lambda tmp, real: write_junk(tmp / "junk.gguf"),
        None, ModelLoadError, r"Could not read .*junk\.gguf as GGUF", id="not-gguf",
    ),
    # a GGUF cut short inside its header (the vocabulary)
    pytest.param(
        lambda tmp, real: truncated_copy(real, tmp / "cut.gguf", 200_000),
        None, ModelLoadError, r"Could not read .*cut\.gguf as GGUF: .*ends inside its header", id="truncated-header",
    ),
    # a GGUF cut short inside its tensor data
    pytest.param(
        lambda tmp, real: truncated_copy(real, tmp / "short.gguf", real.stat().st_size - 4096),
        None, ModelLoadError, r"short\.gguf is truncated: tensor \S+ ends past the end", id="truncated-data",
    ),
    # a GGUF of another architecture
    pytest.param(
        lambda tmp, real: write_tiny_gguf(tmp / "gpt2.gguf", "gpt2", {}),
        None, ModelLoadError, r"general\.architecture='gpt2'", id="gguf-arch-gpt2",
    ),
    # a llama GGUF whose tensor type gguf cannot dequantize
    pytest.param(
        lambda tmp, real: write_tiny_gguf(tmp / "q8_1.gguf", "llama", {"token_embd.weight": q8_1_embedding()}),
        None, ModelLoadError, r"token_embd\.weight has type Q8_1", id="gguf-tensor-q8_1",
    ),
    # a llama GGUF without the tensors a stage needs
    pytest.param(
        lambda tmp, real: write_tiny_gguf(tmp / "empty.gguf", "llama", {}),
        None, ModelLoadError, r"missing tensor 'token_embd\.weight'", id="gguf-missing-tensor",
    ),
    # a layer range past the model's 30 layers
    pytest.param(
        lambda tmp, real: real,
        (20, 31), ValueError, r"inside \[0, 30\) .*got \[20, 31\)", id="range-past-end",
    ),
    # a negative start
    pytest.param(lambda tmp, real: real, (-1, 5), ValueError, r"got \[-1, 5\)", id="range-negative-start"),
    # an empty range
    pytest.param(lambda tmp, real: real, (10, 10), ValueError, r"start < end, got \[10, 10\)", id="range-empty"),
    # a Hugging Face config of another model type
    pytest.param(
        lambda tmp, real: write_hf_dir(tmp / "gpt2", {**TINY_HF_CONFIG, "model_type": "gpt2"}),
        None, ModelLoadError, r"model_type='gpt2'", id="hf-model-type-gpt2",
    ),
    # a llama config with no weight files beside it
    pytest.param(
        lambda tmp, real: write_hf_dir(tmp / "no-weights", TINY_HF_CONFIG),
        None, ModelLoadError, r"no \.safetensors files", id="hf-no-safetensors",
    ),
    # weight files that lack a tensor the stage needs
    pytest.param(
        lambda tmp, real: write_hf_dir(tmp / "partial", TINY_HF_CONFIG, {"model.norm.weight": torch.ones(32)}),
        None, ModelLoadError, r"missing tensor 'model\.embed_tokens\.weight'", id="hf-missing-tensor",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("make_path", "layers", "error", "message"), LOAD_ERRORS)
def test_load_errors_name_the_cause(make_path, layers, error, message, tmp_path, gguf_path):
    path = make_path(tmp_path, gguf_path)
    with pytest.raises(error, match=message) as caught:
        load_stage(path, layers, device="cpu", progress=False)
    assert type(caught.value) is error


def test_gguf_file_reads_what_the_gguf_package_reads(gguf_path):
    """Our header reader (model/gguf_file.py) against the gguf package's GGUFReader:
    every metadata value, and every tensor's name, type, shape, size and bytes."""
    ours, reference = GGUFFile(gguf_path), gguf.GGUFReader(str(gguf_path))
    expected = {key: field.contents() for key, field in reference.fields.items() if not key.startswith("GGUF.")}
    assert ours.fields == expected
    assert len(ours.tensors) == len(reference.tensors)
    for mine, theirs in zip(ours.tensors, reference.tensors):
        assert (mine.name, mine.tensor_type, mine.shape, mine.n_bytes) == (
            theirs.name, theirs.tensor_type, tuple(int(d) for d in theirs.shape), int(theirs.n_bytes))
        assert mine.data.dtype == theirs.data.dtype and np.array_equal(mine.data, theirs.data)
