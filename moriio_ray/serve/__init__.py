"""The OpenAI-compatible HTTP front end on Ray Serve.

``build_app(args)`` returns the Serve application for a pipeline config; ``serve_apps/pd_openai.py``
is the import path that ``serve run configs/<name>.yaml`` uses. The request handling itself
(``handler.OpenAIServer``) does not depend on Serve. Ray Serve loads only when ``build_app`` is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve import Application

    from moriio_ray.config import PipelineConfig

__all__ = ["build_app"]


def build_app(args: dict[str, Any] | PipelineConfig) -> Application:
    """The Serve application for a pipeline config (see ``moriio_ray.serve.app.build_app``)."""
    from moriio_ray.serve.app import build_app as build

    return build(args)
