"""The replies the schema tests ask for, and the checks of each against OpenAI's published schemas.

``KINDS`` lists one request per reply kind (whole, streamed, with and without logprobs and usage);
``ERRORS`` one request per error that needs no special server state. The unit test sends them to
``OpenAIServer`` over a fake pipeline, the e2e test to ``serve run`` over HTTP, and both check the
answers with ``check_reply`` / ``check_error``. A new reply kind (``n``, top logprobs, ``echo``)
is one more line in ``KINDS``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from moriio_ray.serve.handler import MAX_BODY_BYTES
from tests.openai_spec import COMPLETION_CHUNK, problems

COMPLETIONS, CHAT, MODELS = "/v1/completions", "/v1/chat/completions", "/v1/models"
USAGE = {"include_usage": True}
STREAM_USAGE = {"stream": True, "stream_options": USAGE}

# Greedy, a few tokens, EOS ignored: every reply has text (and logprobs) for the schema to check.
_COMMON: dict[str, Any] = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
_PROMPT: dict[str, dict[str, Any]] = {
    COMPLETIONS: {"prompt": "Hello there"},
    CHAT: {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi!"}]},
}
_SCHEMA = {
    (COMPLETIONS, False): "CreateCompletionResponse",
    (COMPLETIONS, True): COMPLETION_CHUNK,
    (CHAT, False): "CreateChatCompletionResponse",
    (CHAT, True): "CreateChatCompletionStreamResponse",
    (MODELS, False): "ListModelsResponse",
}


@dataclass(frozen=True)
class Kind:
    """One reply kind: the request's own fields on top of the endpoint's prompt and ``_COMMON``."""

    name: str
    path: str
    fields: dict[str, Any]

    @property
    def stream(self) -> bool:
        return bool(self.fields.get("stream"))

    @property
    def schema(self) -> str:
        return _SCHEMA[self.path, self.stream]

    @property
    def method(self) -> str:
        return "GET" if self.path == MODELS else "POST"

    @property
    def body(self) -> bytes:
        if self.method == "GET":
            return b""
        return json.dumps({**_COMMON, **_PROMPT[self.path], **self.fields}).encode()


KINDS = [
    Kind("completion", COMPLETIONS, {}),
    Kind("completion logprobs=0", COMPLETIONS, {"logprobs": 0}),
    Kind("completion stream", COMPLETIONS, {"stream": True}),
    Kind("completion stream usage", COMPLETIONS, STREAM_USAGE),
    Kind("completion stream logprobs=0 usage", COMPLETIONS, {**STREAM_USAGE, "logprobs": 0}),
    Kind("chat", CHAT, {}),
    Kind("chat logprobs", CHAT, {"logprobs": True}),
    Kind("chat logprobs top_logprobs=0", CHAT, {"logprobs": True, "top_logprobs": 0}),
    Kind("chat stream", CHAT, {"stream": True}),
    Kind("chat stream usage", CHAT, STREAM_USAGE),
    Kind("chat stream logprobs usage", CHAT, {**STREAM_USAGE, "logprobs": True}),
    Kind("completion n=3 logprobs=5", COMPLETIONS, {"n": 3, "logprobs": 5, "temperature": 1, "seed": 1}),
    Kind("completion stream n=2 logprobs=3 usage", COMPLETIONS, {**STREAM_USAGE, "n": 2, "logprobs": 3}),
    Kind("completion echo", COMPLETIONS, {"echo": True}),
    Kind("completion echo max_tokens=0", COMPLETIONS, {"echo": True, "max_tokens": 0}),
    Kind("completion echo logprobs=2", COMPLETIONS, {"echo": True, "logprobs": 2}),
    Kind(
        "completion echo logprobs=1 max_tokens=0", COMPLETIONS, {"echo": True, "logprobs": 1, "max_tokens": 0}
    ),
    Kind("completion two prompts", COMPLETIONS, {"prompt": ["Hello", "there"], "n": 2}),
    Kind(
        "completion penalties",
        COMPLETIONS,
        {"presence_penalty": 1, "frequency_penalty": 1, "logit_bias": {"5": -100}, "min_tokens": 2},
    ),
    Kind("chat n=2 top_logprobs=5", CHAT, {"n": 2, "logprobs": True, "top_logprobs": 5}),
    Kind(
        "chat stream n=2 top_logprobs=3 usage",
        CHAT,
        {**STREAM_USAGE, "n": 2, "logprobs": True, "top_logprobs": 3},
    ),
    Kind("models", MODELS, {}),
]


@dataclass(frozen=True)
class ErrorCase:
    name: str
    status: int
    method: str
    path: str
    body: bytes


def _json(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


_CHAT_MESSAGES = _PROMPT[CHAT]["messages"]
ERRORS = [
    ErrorCase("invalid JSON", 400, "POST", COMPLETIONS, b'{"prompt": '),
    ErrorCase("wrong type", 400, "POST", COMPLETIONS, _json(prompt="a", max_tokens="ten")),
    ErrorCase("refused field", 400, "POST", CHAT, _json(messages=_CHAT_MESSAGES, tools=[{"type": "x"}])),
    ErrorCase("transfer field", 400, "POST", COMPLETIONS, _json(prompt="a", kv_transfer_params={})),
    ErrorCase("prompt too long", 400, "POST", COMPLETIONS, _json(prompt="y" * 3000)),
    ErrorCase("unknown model", 404, "POST", CHAT, _json(model="gpt-4o", messages=_CHAT_MESSAGES)),
    ErrorCase("unknown route", 404, "GET", "/v1/nothing", b""),
    ErrorCase("wrong method", 405, "GET", COMPLETIONS, b""),
    ErrorCase("body too large", 413, "POST", COMPLETIONS, b" " * (MAX_BODY_BYTES + 1)),
]


def sse_bodies(content: bytes) -> list[Any]:
    """The JSON bodies of an SSE stream, which must be ``data:`` events ending with ``[DONE]``."""
    events = content.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], content[-200:]
    assert all(e.startswith("data: ") for e in events[:-1]), content[:500]
    return [json.loads(e[len("data: ") :]) for e in events[:-2]]


def check_valid(schema: str, body: Any, what: str) -> None:
    errors = problems(schema, body)
    assert not errors, f"{what} does not validate against {schema}:\n" + "\n".join(errors) + f"\n{body}"


def check_reply(kind: Kind, status: int, content: bytes) -> list[Any]:
    """Every body of the reply validates against its schema; returns the bodies."""
    assert status == 200, (kind.name, status, content[:500])
    bodies = sse_bodies(content) if kind.stream else [json.loads(content)]
    for i, body in enumerate(bodies):
        check_valid(kind.schema, _echo_first_logprob(kind, body), f"{kind.name}, body {i}")
    if kind.path != MODELS:
        _check_exercised(kind, bodies)
    return bodies


def _echo_first_logprob(kind: Kind, body: Any) -> Any:
    """``body`` with an echoed prompt's first ``token_logprobs`` and ``top_logprobs`` entries, null
    as OpenAI and vLLM send them (nothing precedes the first token), read as 0 and {} for the
    schema, which has no room for them."""
    if not (kind.fields.get("echo") and kind.fields.get("logprobs") is not None):
        return body
    body = json.loads(json.dumps(body))
    for choice in body["choices"]:
        lp = choice["logprobs"] or {"token_logprobs": [], "top_logprobs": []}
        if lp["token_logprobs"] and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None:
            lp["token_logprobs"][0], lp["top_logprobs"][0] = 0.0, {}
    return body


def _check_exercised(kind: Kind, bodies: list[Any]) -> None:
    """The reply carries what the kind asked for, so that validating it tested those fields."""
    choices = [c for b in bodies for c in b["choices"]]
    assert choices, f"{kind.name}: no choices"
    if kind.fields.get("logprobs") not in (None, False):
        assert any(c["logprobs"] is not None for c in choices), f"{kind.name}: no logprobs"
    top = kind.fields.get("top_logprobs") or kind.fields.get("logprobs")
    if isinstance(top, int) and not isinstance(top, bool) and top > 0:
        if kind.path == CHAT:
            alternatives = [
                t["top_logprobs"] for c in choices if c["logprobs"] for t in c["logprobs"]["content"]
            ]
        else:
            tops = [t for c in choices if c["logprobs"] for t in c["logprobs"]["top_logprobs"]]
            alternatives = [list(t) for t in tops if t is not None]  # an echoed first token: null
        assert alternatives and all(len(a) >= top for a in alternatives), f"{kind.name}: {alternatives[:3]}"
    n = kind.fields.get("n", 1) * len(
        kind.fields.get("prompt", [0]) if isinstance(kind.fields.get("prompt"), list) else [0]
    )
    assert {c["index"] for c in choices} == set(range(n)), f"{kind.name}: choice indices"
    if kind.fields.get("stream_options") == USAGE:
        assert bodies[-1]["usage"] is not None and bodies[-1]["choices"] == [], bodies[-1]


def check_error(case: ErrorCase, status: int, content: bytes) -> None:
    """The error has the case's status and a body that validates against ErrorResponse."""
    assert status == case.status, (case.name, status, content[:500])
    check_valid("ErrorResponse", json.loads(content), case.name)
