"""Chat templates rendered as transformers renders them: sandboxed jinja2 with the same extras.

Real models' templates rely on what transformers' environment adds to plain jinja2:
- the ``loopcontrols`` extension (``{% break %}``, ``{% continue %}``);
- the ``{% generation %}...{% endgeneration %}`` block, which marks the assistant's part for
  training masks and renders its body unchanged;
- a ``tojson`` that writes plain JSON: no HTML escaping of ``<>&'``, non-ASCII kept as is, keys in
  their order (jinja2's own escapes and sorts);
- ``raise_exception(message)`` and ``strftime_now(format)``.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moriio_ray.errors import ConfigError, InvalidRequest


class GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}body{% endgeneration %}`` renders ``body``, as in transformers."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON text of ``value`` with json.dumps' defaults except ensure_ascii (the template decides)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template; ``render`` gives the prompt text for a list of messages."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ConfigError(f"chat_template: does not parse: {exc}") from None
        self._special_tokens = special_tokens

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text; InvalidRequest when the template rejects the messages."""
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
                **extra,
            )
        except (jinja2.TemplateError, TypeError) as exc:  # TypeError: e.g. a str + None in the template
            raise InvalidRequest(f"messages: the chat template rejected them: {exc}") from None
