"""The Ray Serve ingress deployment and ``build_app``, the builder that ``serve run`` calls with ``args:``.

The ingress attaches to the pipeline named ``config.name`` when its coordinator already runs in the
cluster, else launches it (detached, so that other replicas and drivers can attach); on shutdown it
stops the pipeline only if it launched it. With ``serve.num_replicas > 1`` every replica that found
no pipeline may have launched it; the pipeline then stops with the first of them to shut down, so
scale such a deployment down only together with the pipeline.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
from ray import serve
from ray.serve import Application
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from moriio_ray.config import PipelineConfig
from moriio_ray.config_load import parse_pipeline_config
from moriio_ray.errors import ConfigError
from moriio_ray.serve.errors import bad_request, too_large
from moriio_ray.serve.handler import MAX_BODY_BYTES, JSONReply, OpenAIServer, StreamReply, error_reply
from moriio_ray.serve.prepare import Limits

# Serve's logger: its lines reach the replica log and `serve run`'s output with the replica's context.
log = logging.getLogger("ray.serve")

# Serve admits this many requests beyond serve.max_ongoing_requests into the replica, so that the
# replica itself answers the excess with an immediate 429 and /health or /stats still get through.
INGRESS_HEADROOM = 16


def attach_or_launch(config: PipelineConfig) -> tuple[Any, bool]:
    """(pipeline, launched_here): attach to the running pipeline ``config.name``, else launch it."""
    from moriio_ray.caller.pipeline import PDPipeline

    try:
        pipe = PDPipeline.connect(config.name)
    except ConfigError:
        log.info("no pipeline %r is running; launching it", config.name)
        pipe = PDPipeline.launch(config, detached=True)
        log.info("launched the pipeline %r", config.name)
        return pipe, True
    # `serve` configures this ingress, not the pipeline: ingress apps with other serve settings
    # (stream_interval, replicas, limits) may share one pool
    if msgspec.structs.replace(pipe.config, serve=config.serve) != config:
        raise ConfigError(
            f"name: a pipeline named {config.name!r} already runs with another config; shut it down "
            "or give this application's args another name"
        )
    log.info("attached to the running pipeline %r", config.name)
    return pipe, False


class SSEResponse(StreamingResponse):
    """A text/event-stream response that closes its stream however the response ends."""

    def __init__(self, reply: StreamReply) -> None:
        super().__init__(
            reply.frames,
            media_type="text/event-stream",
            headers={**reply.headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._close = reply.close
        self._begin = reply.begin

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._begin()  # before any await: from here on the finally below owns the close
        try:
            await super().__call__(scope, receive, send)
        finally:
            # A client that left mid-stream cancels its request here. In a task of its own, so that
            # a second cancellation of this one cannot cut the close short.
            await asyncio.shield(asyncio.ensure_future(self._close()))


def _json(reply: JSONReply) -> Response:
    return Response(
        reply.body, status_code=reply.status, media_type="application/json", headers=reply.headers
    )


class OpenAIIngress:
    """OpenAI-compatible HTTP ingress over one PDPipeline (see ``moriio_ray.serve.handler``)."""

    async def __init__(self, config: dict[str, Any]) -> None:  # type: ignore[misc]  # Serve awaits it
        cfg = parse_pipeline_config(config)
        self.pipe, self.launched = await asyncio.to_thread(attach_or_launch, cfg)
        max_model_len = self.pipe.max_model_len or cfg.model.max_model_len
        if not max_model_len:
            raise ConfigError("model.max_model_len: the pipeline did not report its length; set it")
        limits = Limits(
            model_name=cfg.model.name,
            max_model_len=max_model_len,
            default_max_tokens=cfg.serve.default_max_tokens,
        )
        self.server = OpenAIServer(
            self.pipe,
            limits,
            max_ongoing_requests=cfg.serve.max_ongoing_requests,
            request_timeout_s=cfg.serve.request_timeout_s,
            live_roles=self._live_roles,
            stream_interval=cfg.serve.stream_interval,
            unknown_fields=cfg.serve.unknown_fields,
        )

    async def _live_roles(self) -> dict[str, int]:
        membership = await self.pipe.coordinator.get_membership.remote(-1, 0.0)
        counts: dict[str, int] = {}
        for member in membership.members:
            counts[member.role] = counts.get(member.role, 0) + 1
        return counts

    async def __call__(self, request: Request) -> Response:
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            return _json(error_reply(too_large(int(length), MAX_BODY_BYTES)))
        path = request.url.path
        root = str(request.scope.get("root_path", ""))
        if root and path.startswith(root):
            path = path[len(root) :]
        try:
            body = await request.body()
        except Exception as exc:  # the client left while sending, or sent a broken body
            log.info("could not read a request body: %r", exc)
            return _json(error_reply(bad_request("the request body could not be read", code="bad_body")))
        reply = await self.server.handle(request.method, path, body)
        if isinstance(reply, JSONReply):
            return _json(reply)
        return SSEResponse(reply)

    def __del__(self) -> None:
        """Serve calls this on graceful shutdown: stop the pipeline if this replica launched it.

        Synchronous on purpose: Python calls ``__del__`` again when it collects the object, and an
        ``async def`` would leave that call's coroutine unawaited. The flag makes the second call a
        no-op. Blocking the replica's loop here is harmless: it has already drained its requests.
        """
        if not getattr(self, "launched", False):
            return
        self.launched = False
        name = self.pipe.config.name
        log.info("stopping the pipeline %r, which this replica launched", name)
        self.pipe.shutdown()
        log.info("stopped the pipeline %r", name)


def build_app(args: dict[str, Any] | PipelineConfig) -> Application:
    """The Serve application for a pipeline config (a Serve config's ``args:``, or a PipelineConfig)."""
    cfg = args if isinstance(args, PipelineConfig) else parse_pipeline_config(args)
    limit = cfg.serve.max_ongoing_requests
    deployment = serve.deployment(
        name="OpenAIIngress",
        num_replicas=cfg.serve.num_replicas,
        max_ongoing_requests=limit + INGRESS_HEADROOM,
        max_queued_requests=limit,  # Serve answers 503 beyond this; never an unbounded queue
        ray_actor_options={"num_cpus": 0},  # I/O bound; the CPUs belong to the engines
        graceful_shutdown_timeout_s=60,
    )(OpenAIIngress)
    return deployment.bind(msgspec.to_builtins(cfg))
