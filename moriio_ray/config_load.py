"""Building a PipelineConfig from plain data or a file, every failure a ConfigError with its path.

``parse_pipeline_config(data)`` takes a dict (a Serve application's ``args:`` or a bare config);
``load_config(path)`` reads a Ray Serve config file (the pipeline config is its application's
``args:``) or a bare pipeline config.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

from moriio_ray.config import PipelineConfig
from moriio_ray.errors import ConfigError

T = TypeVar("T")

_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def _path_of(raw: str) -> str:
    # msgspec writes `$.transfer.mori` or `$.pool.prefill.resources[...]`
    return raw.lstrip(".").replace("[", ".").replace("]", "").replace("'", "").replace('"', "")


def convert(data: Any, type_: type[T], *, where: str = "") -> T:
    """Build a config Struct from plain data, turning every failure into a ConfigError with its path."""
    try:
        return msgspec.convert(data, type_, strict=False)
    except msgspec.ValidationError as exc:
        match = _AT.match(str(exc))
        assert match is not None
        msg, path = match.group("msg"), _path_of(match.group("path") or "")
        unknown = re.match(r"Object contains unknown field `(?P<f>[^`]+)`", msg)
        if unknown:
            field = ".".join(p for p in (path, unknown.group("f")) if p)
            allowed = _fields_at(type_, path)
            raise ConfigError(f"{where}{field}: unknown field; allowed: {', '.join(allowed)}") from None
        if ": " in msg and not msg.startswith(("Expected", "Object")):
            # a ConfigError from __post_init__: 'field: message'; prefix the struct's path
            field, _, rest = msg.partition(": ")
            full = ".".join(p for p in (path, field) if p)
            raise ConfigError(f"{where}{full}: {rest}") from None
        raise ConfigError(f"{where}{path or '<root>'}: {msg}") from None


def _fields_at(type_: Any, path: str) -> list[str]:
    """The field names of the Struct found at a dotted path below type_ (for error messages)."""
    current = type_
    for part in [p for p in path.split(".") if p]:
        fields = {f.name: f.type for f in msgspec.structs.fields(current)} if _is_struct(current) else {}
        nxt = fields.get(part)
        if nxt is None:
            return []
        current = _unwrap(nxt)
    if not _is_struct(current):
        return []
    return [f.name for f in msgspec.structs.fields(current)]


def _is_struct(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, msgspec.Struct)


def _unwrap(t: Any) -> Any:
    for arg in getattr(t, "__args__", ()) or ():
        if _is_struct(arg):
            return arg
    return t


def parse_pipeline_config(data: Any) -> PipelineConfig:
    """A PipelineConfig from a dict (a Serve app's ``args:`` or a bare config)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"<root>: expected a mapping, got {type(data).__name__}")
    return convert(data, PipelineConfig)


def _serve_args(doc: dict[str, Any], app_name: str | None, path: Path) -> dict[str, Any]:
    apps = doc.get("applications")
    if not isinstance(apps, list) or not apps:
        raise ConfigError(f"applications: {path} has no applications")
    if app_name is not None:
        chosen = [a for a in apps if isinstance(a, dict) and a.get("name") == app_name]
        if not chosen:
            names = [str(a.get("name")) for a in apps if isinstance(a, dict)]
            raise ConfigError(f"applications: no application {app_name!r}; have {', '.join(names)}")
    else:
        chosen = [a for a in apps if isinstance(a, dict) and "args" in a] or apps
    args = chosen[0].get("args") if isinstance(chosen[0], dict) else None
    if args is not None and not isinstance(args, dict):
        raise ConfigError(f"applications[0].args: expected a mapping, got {type(args).__name__}")
    return args or {}


def load_config(path: str | Path, *, app_name: str | None = None) -> PipelineConfig:
    """Read a Ray Serve config file (the pipeline config is an application's ``args:``) or a bare one."""
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"<file>: {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"<file>: {path} is not valid YAML: {exc}") from None
    if isinstance(doc, dict) and "applications" in doc:
        return parse_pipeline_config(_serve_args(doc, app_name, path))
    return parse_pipeline_config(doc)
