"""Chat templates render as in transformers: loopcontrols, ``{% generation %}``, a plain ``tojson``."""

from __future__ import annotations

import json

import pytest

from moriio_ray.engine.chat_template import ChatTemplate
from moriio_ray.errors import ConfigError, InvalidRequest

MESSAGES = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": "b"},
    {"role": "user", "content": "c"},
]


def _render(source: str, messages: list | None = None, **extra: object) -> str:
    return ChatTemplate(source, {"bos_token": "<s>", "eos_token": "</s>"}).render(
        MESSAGES if messages is None else messages, **extra
    )


@pytest.mark.timeout(10)
def test_loop_controls() -> None:
    loop = "{% for m in messages %}{% if m.role == ROLE %}{% STATEMENT %}{% endif %}{{ m.content }}"
    loop += "{% endfor %}"
    skip_system = loop.replace("ROLE", "'system'").replace("STATEMENT", "continue")
    assert _render(skip_system) == "abc"
    until_assistant = loop.replace("ROLE", "'assistant'").replace("STATEMENT", "break")
    assert _render(until_assistant) == "sysa"


@pytest.mark.timeout(10)
def test_generation_block_renders_its_body() -> None:
    source = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}"
        "{% generation %}[{{ m.content }}{{ eos_token }}]{% endgeneration %}"
        "{% else %}{{ m.content }}{% endif %}{% endfor %}"
    )
    assert _render(source) == "<s>sysa[b</s>]c"
    with pytest.raises(ConfigError, match="chat_template: does not parse"):
        ChatTemplate("{% generation %}unclosed", {})


@pytest.mark.timeout(10)
def test_tojson_is_plain_json() -> None:
    tool = {"name": "lookup", "z_first": 1, "a_second": "<b>&'quoted'</b>", "city": "Zürich 東京"}
    out = _render("{{ tools[0] | tojson }}", tools=[tool])
    # no HTML escaping of <>&', non-ASCII kept, keys in their order (jinja2's own tojson does all three)
    assert out == json.dumps(tool, ensure_ascii=False)
    assert out == '{"name": "lookup", "z_first": 1, "a_second": "<b>&\'quoted\'</b>", "city": "Zürich 東京"}'
    assert (
        _render("{{ tools[0] | tojson(indent=2) }}", tools=[{"b": 1, "a": 2}]) == '{\n  "b": 1,\n  "a": 2\n}'
    )
    assert _render("{{ x | tojson(sort_keys=True) }}", x={"b": 1, "a": 2}) == '{"a": 2, "b": 1}'


@pytest.mark.timeout(10)
def test_template_errors_are_bad_requests() -> None:
    source = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    with pytest.raises(InvalidRequest, match="first must be user"):
        _render(source)
    assert _render(source, messages=[{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(InvalidRequest, match="the chat template rejected them"):
        _render("{{ messages[0].content + none_value }}", none_value=None)
