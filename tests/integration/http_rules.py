"""HTTP helpers of tests/integration/test_http_failures.py: requests, SSE streams held open in the
background, and the pipeline's workers reached through its coordinator."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import ray

from moriio_ray.coordinator.actor import NAMESPACE, coordinator_name
from tests.integration.helpers import leaks, wait_until


def post(url: str, path: str, body: dict[str, Any], timeout_s: float = 60.0) -> tuple[int, Any]:
    """(status, JSON body) of a POST; an SSE body as the list of its events' JSON, "[DONE]" last."""
    resp = httpx.post(url + path, json=body, timeout=timeout_s)
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        return resp.status_code, events(resp.text)
    return resp.status_code, resp.json()


def events(text: str) -> list[Any]:
    frames = [f.removeprefix("data: ") for f in text.split("\n\n") if f]
    return [f if f == "[DONE]" else json.loads(f) for f in frames]


def health(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=10.0).status_code
    except httpx.HTTPError:
        return 0


class Streams:
    """``n`` SSE streams of ``body`` read on a thread of their own: until ``close`` (which closes
    their connections: their requests are cancelled), or to their end (``join``)."""

    def __init__(self, url: str, body: dict[str, Any], n: int) -> None:
        self.url, self.body, self.n = url, {**body, "stream": True}, n
        self.frames: list[list[str]] = [[] for _ in range(n)]  # each stream's data lines
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    async def _one(self, client: httpx.AsyncClient, frames: list[str]) -> None:
        try:
            async with client.stream("POST", self.url + "/v1/completions", json=self.body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        frames.append(line.removeprefix("data: "))
                    if self._stop.is_set():
                        return
        except httpx.HTTPError:
            pass  # a replica that died breaks its streams

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=self.n + 4)
        async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:
            await asyncio.gather(*(self._one(client, frames) for frames in self.frames))

    def wait_started(self, timeout_s: float) -> None:
        wait_until(lambda: all(self.frames), timeout_s, f"{self.n} streams to start")

    def join(self, timeout_s: float) -> list[list[Any]]:
        """Wait for every stream to end; each one's events (JSON, "[DONE]" last)."""
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the streams did not end"
        return [events("\n\n".join(f"data: {x}" for x in frames)) for frames in self.frames]

    def close(self) -> None:
        """Stop reading: each stream's connection closes (its request is cancelled)."""
        self._stop.set()
        self._thread.join(60.0)


class Pool:
    """The pipeline ``name``'s workers, through its coordinator."""

    def __init__(self, name: str) -> None:
        self.coordinator = ray.get_actor(coordinator_name(name), namespace=NAMESPACE)

    def member(self, key: str) -> Any:
        return ray.get(self.coordinator.lookup.remote(key), timeout=30)

    def call(self, key: str, fn: Any, *args: Any) -> Any:
        member = self.member(key)
        assert member is not None, f"{key} is not a live member"
        return ray.get(member.actor.call.remote(fn, *args), timeout=60)

    def epoch(self, key: str) -> int:
        member = self.member(key)
        return 0 if member is None else int(member.epoch)

    def wait_replaced(self, key: str, old_epoch: int, timeout_s: float = 120.0) -> None:
        wait_until(lambda: self.epoch(key) > old_epoch, timeout_s, f"a replacement of {key}", poll_s=0.1)

    def assert_no_leaks(self, timeout_s: float = 15.0) -> None:
        last: dict[str, Any] = {}

        def clean() -> bool:
            nonlocal last
            last = leaks(ray.get(self.coordinator.stats.remote(), timeout=60))
            return not last

        try:
            wait_until(clean, timeout_s, "every engine's blocks to be free again", poll_s=0.1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {last}") from None


def wait_health(url: str, status: int, timeout_s: float, poll_s: float = 0.05) -> float:
    """Poll /health until it answers ``status``; the seconds that took."""
    t0 = time.monotonic()
    wait_until(lambda: health(url) == status, timeout_s, f"/health to answer {status}", poll_s=poll_s)
    return time.monotonic() - t0
