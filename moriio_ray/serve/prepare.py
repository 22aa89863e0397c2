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
from typing import Any, Protocol

import msgspec

from moriio_ray.engine.sampling import MAX_TOP_LOGPROBS, SamplingParams
from moriio_ray.errors import InvalidRequest
from moriio_ray.serve.errors import APIError, bad_request
from moriio_ray.serve.openai import (
    CHAT_ROLES,
    MAX_CHOICES,
    MAX_N,
    MAX_PROMPTS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)


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
    """A prompt ready for the pipeline; ``fields`` maps the pipeline's field names in its errors
    (``prompt``, ``max_tokens``) to this request's. ``n`` choices are sampled from it; ``echo`` is
    the text put in front of each (None: no echo); ``generate`` False: nothing is generated (echo
    with ``max_tokens: 0``)."""

    token_ids: list[int]
    params: SamplingParams
    fields: dict[str, str] = field(default_factory=dict)
    n: int = 1
    echo: str | None = None
    generate: bool = True
    discard: bool = False  # generated only for its prompt logprobs (echo, max_tokens 0): no output


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


def prepare_completion(req: CompletionRequest, tok: TokenizerLike, limits: Limits) -> list[Prepared]:
    """One ``Prepared`` per prompt of the request (``prompt`` may list several)."""
    check_model(req.model, limits)
    _check_n(req)
    top = _top("logprobs", req.logprobs)
    prompts = _prompts(req.prompt, tok)
    if len(prompts) * req.num_choices > MAX_CHOICES:
        raise bad_request(
            f"prompt: {len(prompts)} prompts x n {req.num_choices} is more than {MAX_CHOICES} choices",
            param="prompt",
        )
    echo = bool(req.echo)
    # echo with max_tokens 0: nothing to generate, unless the prompt's logprobs are wanted (one
    # token is generated for the prefill that computes them, and dropped)
    nothing = echo and req.max_tokens == 0
    discard = nothing and top is not None
    out = []
    for ids, text in prompts:
        max_tokens = 1 if discard else None if nothing else req.max_tokens
        params = _sampling(req, max_tokens, "max_tokens", len(ids), limits, logprobs=top is not None, top=top)
        if echo and top is not None:
            params = msgspec.structs.replace(params, prompt_logprobs=top)
        out.append(
            Prepared(
                ids,
                params,
                n=req.num_choices,
                echo=text if echo else None,
                generate=not nothing or discard,
                discard=discard,
            )
        )
    return out


def prepare_chat(req: ChatCompletionRequest, tok: TokenizerLike, limits: Limits) -> Prepared:
    check_model(req.model, limits)
    top = _top("top_logprobs", req.top_logprobs)
    if top and not req.logprobs:
        raise bad_request("top_logprobs: set logprobs to true to get alternatives", param="top_logprobs")
    response_format = _response_format(req.response_format)
    ids = chat_prompt_ids(req.messages, tok)
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise bad_request(
            "set one of max_completion_tokens and max_tokens (a deprecated alias)",
            param="max_completion_tokens",
        )
    max_tokens, name = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = req.max_tokens, "max_tokens"
    params = _sampling(req, max_tokens, name, len(ids), limits, logprobs=bool(req.logprobs), top=top)
    if response_format is not None:
        params = msgspec.structs.replace(params, response_format=response_format)
    fields = {"prompt": "messages", "max_tokens": name}
    return Prepared(token_ids=ids, params=params, fields=fields, n=req.num_choices)


def chat_prompt_ids(messages: list[ChatMessage], tok: TokenizerLike) -> list[int]:
    """The prompt of a chat: its messages through the chat template, tokenized."""
    if not messages:
        raise bad_request("messages: at least one message is required", param="messages")
    dicts = [_message_dict(i, m.role, m.content) for i, m in enumerate(messages)]
    # The chat template already holds any BOS the model wants.
    return tok.encode(tok.apply_chat_template(dicts), add_special_tokens=False)


def _top(name: str, value: int | None) -> int | None:
    """The alternatives per token asked for (None: no logprobs), 0..20."""
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise bad_request(f"{name}: {value} must be in 0..{MAX_TOP_LOGPROBS}", param=name)
    return value


def _response_format(value: dict[str, Any] | None) -> str | None:
    """A structured-output format as the engine takes it (JSON text), or None for plain text. The
    engine compiles it (a 400 there when its grammar library is missing or the schema fails)."""
    if value is None or value.get("type") == "text":
        return None
    kind = value.get("type")
    if kind == "json_object":
        return msgspec.json.encode({"type": "json_object"}).decode()
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise bad_request(
                "response_format.json_schema: must be an object with a 'schema' object",
                param="response_format.json_schema",
            )
        fmt = {"type": "json_schema", "json_schema": {"schema": spec["schema"]}}
        return msgspec.json.encode(fmt).decode()
    raise bad_request(
        f"response_format.type: {kind!r} is not one of text, json_object, json_schema",
        param="response_format.type",
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


def _prompts(prompt: str | list[object], tok: TokenizerLike) -> list[tuple[list[int], str]]:
    """(token ids, text) per prompt: a string, a list of token ids, or a list of either."""
    if isinstance(prompt, str):
        return [(tok.encode(prompt), prompt)]
    if prompt and all(_is_int(t) for t in prompt):
        ids = [int(t) for t in prompt]  # type: ignore[call-overload]
        return [(ids, tok.decode(ids))]
    if not prompt or len(prompt) > MAX_PROMPTS:
        raise bad_request(f"prompt: send 1..{MAX_PROMPTS} prompts, not {len(prompt)}", param="prompt")
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            out.append((tok.encode(p), p))
        elif isinstance(p, list) and p and all(_is_int(t) for t in p):
            out.append(([int(t) for t in p], tok.decode([int(t) for t in p])))
        else:
            raise bad_request(f"prompt[{i}]: must be a string or a list of token ids", param="prompt")
    return out


def _check_n(req: SamplingFields) -> None:
    if not 1 <= req.num_choices <= MAX_N:
        raise bad_request(f"n: {req.n} must be in 1..{MAX_N}", param="n")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        if not key.isdigit() or len(key) > 9:
            raise bad_request(f"logit_bias: {key[:40]!r} is not a token id", param="logit_bias")
        out[int(key)] = value
    return out


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
    top: int | None,
) -> SamplingParams:
    _check_n(req)
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
            top_logprobs=top or 0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=_logit_bias(req.logit_bias),
            min_tokens=req.min_tokens,
        )
    except InvalidRequest as exc:  # SamplingParams' bounds: "field[: or [index]]: ..."
        field = re.split(r"[:\[]", str(exc), maxsplit=1)[0]
        raise bad_request(str(exc), param=field) from None
