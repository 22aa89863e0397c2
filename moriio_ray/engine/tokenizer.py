"""Tokenizers: a model directory's ``tokenizer.json``, a GGUF file's vocabulary, or a byte-level one.

Chat templates render as in transformers (``chat_template.py``), from ``tokenizer_config.json``'s
``chat_template`` (or ``chat_template.jinja``) or a GGUF file's ``tokenizer.chat_template``; presets
and models without one use a plain ``role: content`` template.
"""

from __future__ import annotations

import abc
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as RustTokenizer

from moriio_ray.config import ModelConfig
from moriio_ray.engine.chat_template import ChatTemplate
from moriio_ray.engine.gguf_file import open_gguf
from moriio_ray.engine.gguf_tokenizer import gguf_vocab
from moriio_ray.engine.model_path import model_source
from moriio_ray.engine.presets import BYTE_VOCAB_SIZE
from moriio_ray.errors import ConfigError, InvalidRequest

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class Tokenizer(abc.ABC):
    """What the engine and the front end need from a tokenizer."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: list[int]

    def __init__(self, chat_template: str, special_tokens: dict[str, str]) -> None:
        self._template = ChatTemplate(chat_template, special_tokens)

    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's BOS when it adds one and add_special_tokens)."""

    @abc.abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``, special tokens skipped; ids outside the vocabulary become U+FFFD."""

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The prompt text for a chat, ending with the assistant's generation prompt."""
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise InvalidRequest(f"messages[{i}]: each message needs a 'role' and a 'content'")
        return self._template.render(messages, add_generation_prompt=True)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, then ``<|bos|>``, ``<|eos|>``, ``<|pad|>``, ``<|unk|>``; adds no BOS."""

    BOS, EOS, PAD, UNK = 256, 257, 258, 259

    def __init__(self) -> None:
        super().__init__(DEFAULT_CHAT_TEMPLATE, {"bos_token": "", "eos_token": ""})
        self.vocab_size = BYTE_VOCAB_SIZE
        self.bos_token_id = self.BOS
        self.eos_token_ids = [self.EOS]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        out = bytearray()
        for i in ids:
            if 0 <= i < 256:
                out.append(i)
            elif i >= self.vocab_size or i < 0:
                out.extend("\ufffd".encode())
        return out.decode("utf-8", errors="replace")


class RustBackedTokenizer(Tokenizer):
    """A ``tokenizers`` tokenizer with a chat template, special tokens and EOS ids."""

    def __init__(
        self,
        tok: RustTokenizer,
        chat_template: str | None,
        special_tokens: dict[str, str],
        bos_token_id: int | None,
        eos_token_ids: list[int],
    ) -> None:
        super().__init__(chat_template or DEFAULT_CHAT_TEMPLATE, special_tokens)
        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = sorted(set(eos_token_ids))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int]) -> str:
        known = [i if 0 <= i < self.vocab_size else None for i in ids]
        if all(i is not None for i in known):
            return self._tok.decode(ids, skip_special_tokens=True)
        # decode runs of known ids; an unknown id becomes U+FFFD
        parts: list[str] = []
        run: list[int] = []
        for i in known:
            if i is None:
                parts.append(self._tok.decode(run, skip_special_tokens=True) + "\ufffd")
                run = []
            else:
                run.append(i)
        parts.append(self._tok.decode(run, skip_special_tokens=True))
        return "".join(parts)


class HFTokenizer(RustBackedTokenizer):
    """A model directory's ``tokenizer.json``, its chat template and its EOS ids."""

    def __init__(self, model_dir: Path) -> None:
        cfg = _read_json(model_dir / "tokenizer_config.json")
        special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        tok = RustTokenizer.from_file(str(model_dir / "tokenizer.json"))
        bos, eos = special["bos_token"], special["eos_token"]
        eos_ids = _as_list(_read_json(model_dir / "generation_config.json").get("eos_token_id"))
        eos_id = tok.token_to_id(eos) if eos else None
        if eos_id is not None:
            eos_ids.append(eos_id)
        super().__init__(
            tok,
            _chat_template(model_dir, cfg),
            {k: v or "" for k, v in special.items()},
            tok.token_to_id(bos) if bos else None,
            eos_ids,
        )


class GGUFTokenizer(RustBackedTokenizer):
    """The tokenizer a GGUF file describes (``gguf_tokenizer.py``), with its chat template."""

    def __init__(self, path: Path) -> None:
        vocab = gguf_vocab(open_gguf(path))
        super().__init__(
            vocab.tokenizer,
            vocab.chat_template,
            vocab.special_tokens,
            vocab.bos_token_id,
            vocab.eos_token_ids,
        )


def _chat_template(model_dir: Path, cfg: dict[str, Any]) -> str | None:
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_file = model_dir / "chat_template.jinja"
    if not template and jinja_file.is_file():
        template = jinja_file.read_text()
    return str(template) if template else None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return str(value.get("content")) if value.get("content") is not None else None
    return str(value) if value is not None else None


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path.name}: is not valid JSON: {exc}") from None
    return data if isinstance(data, dict) else {}


def load_tokenizer(config: ModelConfig) -> Tokenizer:
    """The byte tokenizer for presets; a GGUF file's vocabulary; a directory's ``tokenizer.json``."""
    if config.preset is not None:
        return ByteTokenizer()
    source = model_source(config)
    if source.is_file():
        return GGUFTokenizer(source)
    if not (source / "tokenizer.json").is_file():
        raise ConfigError(f"model.path: {source} has no tokenizer.json")
    return HFTokenizer(source)
