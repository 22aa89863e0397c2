"""A request's choices (``n`` per prompt, each its own pipeline request): the order in which they
start, so that ``n`` samples of one prompt share its prefill through the prefix cache, and the
``Source`` each streams from, with its echo of the prompt in front."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from moriio_ray.serve.prepare import Prepared
from moriio_ray.serve.stream import Merged, Source


def phases(choices: list[tuple[Prepared, Any]], shares_prefill: bool) -> list[list[int]]:
    """The order in which the live choices (indices among them) start. With a prefix cache, a
    prompt's first choice goes alone first: once its first token is out, the prompt's blocks are
    cached and its other choices find them there, so ``n`` samples cost one prefill (and a
    partial last block each). Without one, every choice starts at once."""
    groups: dict[int, list[int]] = {}  # prompt -> its live choices
    live = [prepared for prepared, req in choices if req is not None]
    for i, prepared in enumerate(live):
        groups.setdefault(id(prepared), []).append(i)
    everyone = list(range(len(live)))
    rest = [i for g in groups.values() for i in g[1:]]
    if not shares_prefill or not rest:
        return [everyone]
    return [[g[0] for g in groups.values()], rest]


def sources(
    choices: list[tuple[Prepared, Any]], firsts: list[Any], streams: list[AsyncIterator[Any]]
) -> list[Source]:
    """A ``Source`` per choice: its first event and stream, and its echo."""
    out: list[Source] = []
    live = iter(zip(firsts, streams, strict=True))
    seen: set[int] = set()
    for prepared, req in choices:
        counts_prompt = id(prepared) not in seen
        seen.add(id(prepared))
        first, events = next(live) if req is not None else (None, None)
        prefix = None if prepared.echo is None else echo(prepared, first)
        if req is None or prepared.discard:  # echo alone (max_tokens 0): the prompt is the choice
            assert prefix is not None
            prefix.finished, prefix.finish_reason = True, "length"
            out.append(Source(prefix, None, None, counts_prompt))
            continue
        assert first is not None
        out.append(Source(first, events, prefix, counts_prompt))
    return out


def echo(prepared: Prepared, first: Any) -> Merged:
    """The prompt in front of a choice: its text and, when the first event carries them, its
    tokens' log probabilities and alternatives (then the tokens are listed too)."""
    prompt_logprobs = getattr(first, "prompt_logprobs", None)
    return Merged(
        token_ids=list(prepared.token_ids) if prompt_logprobs is not None else [],
        text=prepared.echo or "",
        logprobs=prompt_logprobs.logprobs if prompt_logprobs is not None else None,
        finished=False,
        finish_reason=None,
        num_prompt_tokens=len(prepared.token_ids),
        num_output_tokens=0,
        num_cached_tokens=getattr(first, "num_cached_tokens", 0),
        top_logprobs=prompt_logprobs.top if prompt_logprobs is not None else None,
    )
