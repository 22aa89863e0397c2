"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's extension): the served model's tokenizer over
HTTP, so that a client can count tokens, build ``logit_bias`` or read token ids back.

``/tokenize`` takes ``prompt`` (with ``add_special_tokens``, default true) or chat ``messages`` (the
chat template applied, as a chat request's prompt) and answers ``{"tokens", "count",
"max_model_len"}``; ``/detokenize`` takes ``tokens`` and answers ``{"prompt"}``.
"""

from __future__ import annotations

import msgspec

from moriio_ray.serve.errors import bad_request
from moriio_ray.serve.openai import ChatMessage, parse_request
from moriio_ray.serve.prepare import Limits, TokenizerLike, chat_prompt_ids, check_model


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[int]


def tokenize(body: bytes, tok: TokenizerLike, limits: Limits) -> bytes:
    req = parse_request(body, TokenizeRequest)
    check_model(req.model, limits)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of prompt and messages", param="prompt")
    if req.prompt is not None:
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        assert req.messages is not None
        ids = chat_prompt_ids(req.messages, tok)
    return msgspec.json.encode({"tokens": ids, "count": len(ids), "max_model_len": limits.max_model_len})


def detokenize(body: bytes, tok: TokenizerLike, limits: Limits) -> bytes:
    req = parse_request(body, DetokenizeRequest)
    check_model(req.model, limits)
    bad = next((t for t in req.tokens if not 0 <= t < tok.vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"tokens: {bad} is not a token id of this model (0..{tok.vocab_size - 1})", param="tokens"
        )
    return msgspec.json.encode({"prompt": tok.decode(req.tokens)})
