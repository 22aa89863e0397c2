"""The byte-level tokenizer of the presets, and a model directory's tokenizer.json + chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from moriio_ray.config import ModelConfig
from moriio_ray.engine.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from moriio_ray.errors import ConfigError, InvalidRequest

CHAT = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.timeout(10)
def test_byte_tokenizer_round_trip() -> None:
    tok = load_tokenizer(ModelConfig(preset="tiny"))
    assert isinstance(tok, ByteTokenizer)
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert ids == list(text.encode()) and tok.decode(ids) == text
    assert tok.decode([104, tok.EOS, 105, tok.BOS]) == "hi"  # specials are skipped
    assert tok.decode([104, 5000, 105]) == "h\ufffdi"  # outside the vocabulary
    assert tok.eos_token_ids == [257] and tok.bos_token_id == 256 and tok.vocab_size == 260
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    )
    assert prompt == "system: be brief\nuser: hi\nassistant:"
    with pytest.raises(InvalidRequest, match="messages"):
        tok.apply_chat_template([{"content": "no role"}])


def _write_hf_tokenizer(path: Path, chat_template: str | None) -> None:
    tok = RustTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<|im_end|>"])
    tok.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 20, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save(str(path / "tokenizer.json"))
    cfg: dict = {"bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [tok.token_to_id("<|im_end|>")]})
    )
    (path / "config.json").write_text("{}")


@pytest.mark.timeout(10)
def test_hf_tokenizer_from_a_directory(tmp_path: Path) -> None:
    _write_hf_tokenizer(tmp_path, CHAT)
    tok = load_tokenizer(ModelConfig(preset=None, path=str(tmp_path)))
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode("hello world")
    assert ids[0] == tok.bos_token_id and tok.encode("hello world", add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == "hello world"
    assert tok.decode([*ids, tok.vocab_size + 5]) == "hello world\ufffd"
    assert tok.eos_token_ids == sorted({tok._tok.token_to_id("</s>"), tok._tok.token_to_id("<|im_end|>")})
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<s><|user|>hi</s><|assistant|>"
    with pytest.raises(InvalidRequest, match="no tools here"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.mark.timeout(10)
def test_chat_template_sources(tmp_path: Path) -> None:
    _write_hf_tokenizer(tmp_path, [{"name": "default", "template": "D{{ messages[0]['content'] }}"}])  # type: ignore[arg-type]
    assert HFTokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "Dx"
    _write_hf_tokenizer(tmp_path, None)
    (tmp_path / "chat_template.jinja").write_text("J{{ messages[0]['content'] }}")
    assert HFTokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "y"}]) == "Jy"
    (tmp_path / "chat_template.jinja").unlink()
    assert (
        HFTokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "z"}]) == "user: z\nassistant:"
    )
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"tokenizer\.json"):
        load_tokenizer(ModelConfig(preset=None, path=str(tmp_path)))
