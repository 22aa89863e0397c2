"""Turn a parsed OpenAI request into what the pipeline takes: prompt token ids and SamplingParams.

This parses, tokenizes and fills defaults; it checks only what is particular to the OpenAI request
(its shape, the model name, ``n``, the roles). The request's check against the model (empty prompt,
token ids, the length rule) is ``PDPipeline.make_request``'s, once for both front ends; its errors
name the pipeline's fields, which ``Prepared.fields`` maps to this request's (``messages``,
``max_completion_tokens``). Length rule: a prompt that leaves no room for one output token, or a
``max_tokens`` that does not fit after the prompt, is a 400 with code ``context_length_exceeded``
(what OpenAI answers, and what OpenAI clients already handle), not a 413: 413 is kept for bodies
over ``MAX_BODY_BYTES``. Without ``max_tokens`` the server uses ``serve.default_max_tokens``, cut to
the room left.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol

from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.errors import InvalidRequest
from moriio_ray.serve.errors import APIError, bad_request
from moriio_ray.serve.openai import CHAT_ROLES, ChatCompletionRequest, CompletionRequest, SamplingFields


class TokenizerLike(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str: ...


@dataclass(frozen=True)
class Limits:
    """What the served model allows."""

    model_name: str
    max_model_len: int
    default_max_tokens: int


@dataclass(frozen=True)
class Prepared:
    """A request ready for the pipeline; ``fields`` maps the pipeline's field names in its errors
    (``prompt``, ``max_tokens``) to this request's."""

    token_ids: list[int]
    params: SamplingParams
    fields: dict[str, str] = field(default_factory=dict)


def check_model(requested: str | None, limits: Limits) -> None:
    """404 unless ``requested`` is the served model (or omitted)."""
    if requested is not None and requested != limits.model_name:
        raise APIError(
            404,
            f"the model {requested!r} does not exist here; this server serves {limits.model_name!r} "
            "(see GET /v1/models)",
            param="model",
            code="model_not_found",
        )


def prepare_completion(req: CompletionRequest, tok: TokenizerLike, limits: Limits) -> Prepared:
    check_model(req.model, limits)
    _only_zero(req.logprobs, "logprobs")
    ids = _prompt_ids(req.prompt, tok)
    params = _sampling(req, req.max_tokens, "max_tokens", len(ids), limits, logprobs=req.logprobs == 0)
    return Prepared(token_ids=ids, params=params)


def prepare_chat(req: ChatCompletionRequest, tok: TokenizerLike, limits: Limits) -> Prepared:
    check_model(req.model, limits)
    _only_zero(req.top_logprobs, "top_logprobs")
    if not req.messages:
        raise bad_request("messages: at least one message is required", param="messages")
    messages = [_message_dict(i, m.role, m.content) for i, m in enumerate(req.messages)]
    # The chat template already holds any BOS the model wants.
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise bad_request(
            "set one of max_completion_tokens and max_tokens (a deprecated alias)",
            param="max_completion_tokens",
        )
    max_tokens, name = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = req.max_tokens, "max_tokens"
    params = _sampling(req, max_tokens, name, len(ids), limits, logprobs=req.logprobs)
    return Prepared(token_ids=ids, params=params, fields={"prompt": "messages", "max_tokens": name})


def _only_zero(value: int | None, name: str) -> None:
    if value not in (None, 0):
        raise bad_request(
            f"{name}: only 0 is supported (the sampled token's log probability, no alternatives)",
            param=name,
        )


def _message_dict(index: int, role: str, content: object) -> dict[str, str]:
    if role not in CHAT_ROLES:
        raise bad_request(
            f"messages[{index}].role: {role!r} is not one of {', '.join(CHAT_ROLES)}",
            param=f"messages[{index}].role",
        )
    if content is None:
        return {"role": role, "content": ""}
    if isinstance(content, str):
        return {"role": role, "content": content}
    texts: list[str] = []
    assert isinstance(content, list)  # the schema allows str | list[TextPart] | None
    for j, part in enumerate(content):
        if part.type != "text":
            raise bad_request(
                f"messages[{index}].content[{j}].type: {part.type!r} is not supported; only 'text' parts",
                param=f"messages[{index}].content[{j}].type",
            )
        texts.append(part.text)
    return {"role": role, "content": "\n".join(texts)}


def _prompt_ids(prompt: str | list[object], tok: TokenizerLike) -> list[int]:
    if isinstance(prompt, str):
        ids = tok.encode(prompt)
    elif prompt and all(_is_int(t) for t in prompt):
        ids = [int(t) for t in prompt]  # type: ignore[call-overload]
    elif len(prompt) == 1 and isinstance(prompt[0], str):
        ids = tok.encode(prompt[0])
    elif len(prompt) == 1 and isinstance(prompt[0], list) and all(_is_int(t) for t in prompt[0]):
        ids = [int(t) for t in prompt[0]]
    elif len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request(
            f"prompt: batches are not supported ({len(prompt)} prompts); send one prompt per request",
            param="prompt",
        )
    else:
        raise bad_request("prompt: must be a string or a list of token ids", param="prompt")
    return ids


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sampling(
    req: SamplingFields,
    max_tokens: int | None,
    max_name: str,
    num_prompt_tokens: int,
    limits: Limits,
    *,
    logprobs: bool,
) -> SamplingParams:
    if req.n != 1:
        raise bad_request(f"n: {req.n} is not supported; this server returns one choice (n = 1)", param="n")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{max_name}: {max_tokens} must be at least 1", param=max_name)
    # the default is cut to the room left (at least 1: a prompt with no room is make_request's 400)
    room = max(1, limits.max_model_len - num_prompt_tokens)
    try:
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else min(limits.default_max_tokens, room),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            seed=req.seed,
            stop=req.stop_list(),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
        )
    except InvalidRequest as exc:  # SamplingParams' bounds: "field[: or [index]]: ..."
        field = re.split(r"[:\[]", str(exc), maxsplit=1)[0]
        raise bad_request(str(exc), param=field) from None
