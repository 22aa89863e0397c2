"""``import_path: serve_apps.pd_openai:app`` in every config under ``configs/``.

``serve run configs/<name>.yaml`` imports ``app`` and, because it is a function taking one
parameter, calls it with the application's ``args:`` mapping (the pipeline config).
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from moriio_ray.serve import build_app


def app(args: dict[str, Any]) -> Application:
    """Build the OpenAI ingress over the pipeline that ``args`` (a PipelineConfig mapping) describes."""
    return build_app(args)
