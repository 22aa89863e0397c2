"""Structured output: token masks from a grammar library, for ``response_format`` json_object and
json_schema.

The library is optional (``pip install moriio-ray[structured]``): ``available()`` says whether it
is importable, and the front end answers a clear 400 when it is not. ``GrammarBackend`` compiles a
request's format once per engine (cached by its JSON text) and gives each request a ``Matcher``;
a step fills one bitmask [R, ceil(V / 32)] int32 for all its constrained rows and applies it to the
batch's logits in one masked fill. A matcher is made where a request is first sampled under its
format and first fed every output token it already has, so a decode engine (which gets the
prefill engine's first token) and a recomputed request continue in the same grammar state.

Backends: xgrammar (the default: ``bench/grammar_bench.py`` measured its mask cheaper per token
on SmolLM2's vocabulary) and llguidance, behind the same two methods.
"""

from __future__ import annotations

import importlib.util
import json
import weakref
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch

from moriio_ray.engine.sequence import Sequence
from moriio_ray.engine.tokenizer import ByteTokenizer, RustBackedTokenizer, Tokenizer
from moriio_ray.errors import InvalidRequest

BACKENDS = ("xgrammar", "llguidance")
DEFAULT_BACKEND = "xgrammar"


def available(backend: str = DEFAULT_BACKEND) -> bool:
    """Whether the grammar library ``backend`` can be imported here."""
    return importlib.util.find_spec(backend) is not None


def format_schema(response_format: dict[str, Any] | str) -> dict[str, Any]:
    """The JSON schema a ``response_format`` (or its JSON text) constrains to (json_object: any
    object)."""
    if isinstance(response_format, str):
        response_format = json.loads(response_format)
        assert isinstance(response_format, dict)
    kind = response_format.get("type")
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise InvalidRequest("response_format.json_schema: must be an object with a 'schema' object")
        schema: dict[str, Any] = spec.get("schema", {})
        return schema
    raise InvalidRequest(f"response_format.type: {kind!r} is not one of text, json_object, json_schema")


class Matcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row ``row`` of ``bitmask`` [R, W] int32 (CPU): bit t set where token t is allowed next."""

    @abstractmethod
    def accept(self, token: int) -> None:
        """Advance past ``token`` (one the mask allowed)."""


class GrammarBackend(ABC):
    """Compiles formats for one tokenizer; ``matcher`` is the per-request entry point."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self._compiled: dict[str, Any] = {}

    def matcher(self, response_format: dict[str, Any] | str) -> Matcher:
        key = json.dumps(format_schema(response_format))  # key order matters: the grammar keeps it
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = self._compile(key)
        return self._matcher(compiled)

    @abstractmethod
    def _compile(self, schema_json: str) -> Any: ...

    @abstractmethod
    def _matcher(self, compiled: Any) -> Matcher: ...


def _token_bytes(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
    """Each token id's bytes, for a byte tokenizer (specials: empty)."""
    return [bytes([i]) if i < 256 else b"" for i in range(vocab_size)]


class _ByteTokens:
    """What llguidance's TokenizerWrapper reads of a tokenizer without a ``tokenizers`` JSON."""

    def __init__(self, tokenizer: ByteTokenizer, vocab_size: int) -> None:
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = tokenizer.BOS
        self.tokens = _token_bytes(tokenizer, vocab_size)
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


class LLGuidanceBackend(GrammarBackend):
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        super().__init__(tokenizer, vocab_size)
        import llguidance

        self._llg = llguidance
        eos = list(tokenizer.eos_token_ids)
        if isinstance(tokenizer, RustBackedTokenizer):
            source: Any = tokenizer._tok.to_str()
        elif isinstance(tokenizer, ByteTokenizer):
            source = llguidance.TokenizerWrapper(_ByteTokens(tokenizer, vocab_size))
        else:
            raise InvalidRequest(
                f"response_format: structured output does not support {type(tokenizer).__name__}"
            )
        self.tok = llguidance.LLTokenizer(source, n_vocab=vocab_size, eos_token=eos)

    def _compile(self, schema_json: str) -> Any:
        grammar = self._llg.LLMatcher.grammar_from_json_schema(
            schema_json, defaults={"whitespace_flexible": False}
        )
        error = self._llg.LLMatcher.validate_grammar(grammar, self.tok)
        if error:
            raise InvalidRequest(f"response_format: the schema cannot be compiled: {error[:300]}")
        return grammar

    def _matcher(self, compiled: Any) -> Matcher:
        return _LLGMatcher(self._llg.LLMatcher(self.tok, compiled, log_level=0))


class _LLGMatcher(Matcher):
    def __init__(self, matcher: Any) -> None:
        self.m = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        width = bitmask.shape[1]
        self.m.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * width * 4, width * 4)

    def accept(self, token: int) -> None:
        self.m.consume_token(token)


class XGrammarBackend(GrammarBackend):
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        super().__init__(tokenizer, vocab_size)
        import xgrammar

        self._xgr = xgrammar
        eos = list(tokenizer.eos_token_ids)
        if isinstance(tokenizer, RustBackedTokenizer):
            vocab = tokenizer._tok.get_vocab(with_added_tokens=True)
            encoded = [""] * vocab_size
            for text, i in vocab.items():
                if i < vocab_size:
                    encoded[i] = text
            info = xgrammar.TokenizerInfo(
                encoded, vocab_type=xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=eos
            )
        elif isinstance(tokenizer, ByteTokenizer):
            info = xgrammar.TokenizerInfo(
                _token_bytes(tokenizer, vocab_size),
                vocab_type=xgrammar.VocabType.RAW,
                vocab_size=vocab_size,
                stop_token_ids=eos,
            )
        else:
            raise InvalidRequest(
                f"response_format: structured output does not support {type(tokenizer).__name__}"
            )
        self.compiler = xgrammar.GrammarCompiler(info)

    def _compile(self, schema_json: str) -> Any:
        try:
            return self.compiler.compile_json_schema(schema_json, any_whitespace=False, separators=(",", ":"))
        except Exception as exc:
            raise InvalidRequest(
                f"response_format: the schema cannot be compiled: {str(exc)[:300]}"
            ) from None

    def _matcher(self, compiled: Any) -> Matcher:
        return _XGRMatcher(self._xgr.GrammarMatcher(compiled))


class _XGRMatcher(Matcher):
    def __init__(self, matcher: Any) -> None:
        self.m = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        self.m.accept_token(token)


def make_backend(name: str, tokenizer: Tokenizer, vocab_size: int) -> GrammarBackend:
    if not available(name):
        raise InvalidRequest(
            f"response_format: structured output needs the {name} package, which is not installed "
            "here (pip install 'moriio-ray[structured]')"
        )
    return {"llguidance": LLGuidanceBackend, "xgrammar": XGrammarBackend}[name](tokenizer, vocab_size)


def bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask [rows, ceil(V / 32)] int32 on the CPU."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


_BITS = torch.arange(32, dtype=torch.int32)


@torch.inference_mode()
def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
    """Set ``logits[rows[i], t]`` to -inf where bit t of ``mask[i]`` is clear; one masked fill."""
    vocab = logits.shape[1]
    device = logits.device
    words = mask.to(device, non_blocking=True)  # [N, W]
    allowed = ((words[:, :, None] >> _BITS.to(device)) & 1).reshape(len(rows), -1)[:, :vocab]  # [N, V]
    index = torch.as_tensor(np.asarray(rows, dtype=np.int64), device=device)
    sub = logits.index_select(0, index).masked_fill_(allowed == 0, float("-inf"))
    logits.index_copy_(0, index, sub)


class Constraints:
    """An engine's structured-output state: its backend (made on first use) and each constrained
    sequence's matcher, fed the sequence's output tokens as the host learns them."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, backend: str = DEFAULT_BACKEND) -> None:
        self.tokenizer, self.vocab_size, self.backend_name = tokenizer, vocab_size, backend
        self._backend: GrammarBackend | None = None
        # per sequence: [its matcher, how many of its output tokens it has accepted]
        self._matchers: weakref.WeakKeyDictionary[Sequence, list[Any]] = weakref.WeakKeyDictionary()

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            self._backend = make_backend(self.backend_name, self.tokenizer, self.vocab_size)
        return self._backend

    def check(self, response_format: str) -> None:
        """InvalidRequest unless the format compiles (admission)."""
        self.backend.matcher(response_format)

    def masks(self, seqs: list[Sequence]) -> tuple[list[int], torch.Tensor] | None:
        """(rows, bitmask [N, W]) for the constrained ``seqs``, or None when none is."""
        rows = [i for i, s in enumerate(seqs) if s.params.response_format is not None]
        if not rows:
            return None
        mask = bitmask(len(rows), self.vocab_size)
        for j, i in enumerate(rows):
            seq = seqs[i]
            assert not seq.num_pending, "a constrained row needs its tokens on the host"
            self._matcher(seq).fill(mask, j)
        return rows, mask

    def _matcher(self, seq: Sequence) -> Matcher:
        entry = self._matchers.get(seq)
        if entry is None:
            assert seq.params.response_format is not None
            matcher = self.backend.matcher(seq.params.response_format)
            # a continuation's prompt ends with what it emitted before: that is output too
            emitted = seq.prompt_ids[len(seq.prompt_ids) - seq.sample_offset :] if seq.sample_offset else []
            for token in emitted:
                matcher.accept(token)
            entry = self._matchers[seq] = [matcher, 0]
        matcher, fed = entry
        for token in seq.output_ids[fed:]:
            matcher.accept(token)
        entry[1] = len(seq.output_ids)
        return matcher
