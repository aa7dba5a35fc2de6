"""lm-evaluation-harness's `local-completions` model against a running `skippy serve --stages 1`
(float32 weights) on a small multiple-choice task written here (a local task YAML over a local
jsonl file: no download, no hub). Each item's log-likelihoods must match transformers' sum of
the continuation tokens' log-softmax on the same GGUF."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest
import torch

from frontend_support import ServeProcess

pytestmark = pytest.mark.slow

ITEMS = [
    {"question": "Question: What is the capital of France?\nAnswer:", "choices": [" Paris", " Berlin", " Madrid"],
     "answer": 0},
    {"question": "Question: How many days are in a week?\nAnswer:", "choices": [" five", " seven", " ten"],
     "answer": 1},
    {"question": "Question: Which animal barks?\nAnswer:", "choices": [" a cat", " a fish", " a dog"], "answer": 2},
]
TASK = """task: skippy_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def encode_pair(hf_tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's own split (TemplateLM._encode_pair for causal models): trailing spaces move to
    the continuation, the whole text is encoded, the context's tokens come off the front."""
    num_spaces = len(context) - len(context.rstrip())
    if num_spaces:
        context, continuation = context[:-num_spaces], context[-num_spaces:] + continuation
    whole = hf_tokenizer(context + continuation, add_special_tokens=False).input_ids
    context_ids = hf_tokenizer(context, add_special_tokens=False).input_ids
    return context_ids, whole[len(context_ids):]


def test_lm_eval_local_completions_matches_transformers(tmp_path, hf_model, hf_tokenizer, monkeypatch):
    import lm_eval  # the harness under test: missing, it fails the run (never a skip)
    from lm_eval.tasks import TaskManager

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "skippy_mc.yaml").write_text(TASK.format(data=data))
    tokenizer_dir = tmp_path / "tokenizer"
    hf_tokenizer.save_pretrained(tokenizer_dir)  # lm-eval's tokenizer, from a local directory

    server = ServeProcess(["--stages", "1", "--dtype", "float32", "--ctx-size", "512"], tmp_path / "serve.log")
    try:
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=dict(model=model, base_url=server.url + "/v1/completions", tokenizer=str(tokenizer_dir),
                            tokenizer_backend="huggingface", tokenized_requests=True, num_concurrent=1,
                            max_retries=1, batch_size=1),
            tasks=["skippy_mc"], task_manager=TaskManager(include_path=str(tasks)), log_samples=True,
        )
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log_text()[-3000:]

    samples = sorted(results["samples"]["skippy_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(ITEMS)
    for sample, item in zip(samples, ITEMS):
        assert len(sample["resps"]) == len(item["choices"])
        for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
            got = response[0][0]
            context_ids, continuation_ids = encode_pair(hf_tokenizer, context, continuation)
            ids = context_ids + continuation_ids
            with torch.inference_mode():
                log_probs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
            expected = sum(float(log_probs[len(context_ids) - 1 + j, token])
                           for j, token in enumerate(continuation_ids))
            assert abs(got - expected) < 1e-3 * len(continuation_ids), (context, continuation, got, expected)
    assert results["results"]["skippy_mc"]["acc,none"] >= 2 / 3  # the model answers these mostly right
