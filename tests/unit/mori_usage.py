"""What the mori adapter uses of ``mori.io``, checked against a ``Surface`` read from the real wheel.

Two views, because neither alone is enough:

- **Dynamic** (``Spy``): ``spy_modules`` wraps the fake ``mori.io`` so that every object the adapter
  gets from it is a proxy. Each attribute the adapter reads and each call it makes is checked, as it
  happens, against the real class it stands for: the member must exist there, a call must fit the
  real parameters (arity, keyword names), a pybind config must be built from real keywords. It sees
  the class of every object, but only on the paths that the scenarios run.
- **Static** (``adapter_names``): every attribute name and keyword in the adapter's source files.
  Names that moriio-ray defines itself, or that the standard library, numpy or torch give, are set
  aside; each remaining one must be a name of the real API, and must have been seen by the spy, so
  that no call to MoRI sits on a path the dynamic check never ran.
"""

from __future__ import annotations

import ast
import builtins
import enum
import inspect
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mori_surface import ENUM_ATTRS, ClassSurface, Surface

ROOT = Path(__file__).resolve().parents[2]
_TRANSFER = ROOT / "moriio_ray" / "transfer"
ADAPTER_FILES = (_TRANSFER / "mori.py", _TRANSFER / "mori_api.py", _TRANSFER / "mori_status.py")


class SurfaceMismatch(AssertionError):
    """The adapter used a name or a call shape that the real ``mori.io`` does not have."""


@dataclass
class Recorder:
    surface: Surface
    used: set[tuple[str, str]] = field(default_factory=set)  # (real class or "mori.io", name)
    errors: list[str] = field(default_factory=list)

    def fail(self, message: str) -> SurfaceMismatch:
        self.errors.append(message)
        return SurfaceMismatch(f"{message} (amd-mori {self.surface.version})")

    def names(self) -> set[str]:
        return {name for _, name in self.used}


def _unwrap(value: Any) -> Any:
    if isinstance(value, Spy):
        return object.__getattribute__(value, "_target")
    if isinstance(value, list):
        return [_unwrap(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_unwrap(v) for v in value)
    return value


class Spy:
    """Stands for one object of the fake: a module, a class, an instance or a bound callable."""

    __slots__ = ("__weakref__", "_cls", "_kind", "_name", "_rec", "_target")

    def __init__(self, target: Any, cls: ClassSurface | None, kind: str, name: str, rec: Recorder) -> None:
        for slot, value in (("_target", target), ("_cls", cls), ("_kind", kind), ("_name", name)):
            object.__setattr__(self, slot, value)
        object.__setattr__(self, "_rec", rec)

    def _parts(self) -> tuple[Any, ClassSurface | None, str, str, Recorder]:
        get = object.__getattribute__
        return (
            get(self, "_target"),
            get(self, "_cls"),
            get(self, "_kind"),
            get(self, "_name"),
            get(self, "_rec"),
        )

    def __getattr__(self, attr: str) -> Any:
        target, cls, kind, name, rec = Spy._parts(self)
        return _access(rec, target, cls, kind, name, attr)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        target, cls, kind, name, rec = Spy._parts(self)
        _check_call(rec, cls, kind, name, len(args), frozenset(kwargs))
        return _wrap(rec, target(*_unwrap(args), **{k: _unwrap(v) for k, v in kwargs.items()}))

    def __bool__(self) -> bool:
        return bool(object.__getattribute__(self, "_target"))

    def __repr__(self) -> str:
        return f"Spy({object.__getattribute__(self, '_target')!r})"


def _access(rec: Recorder, target: Any, cls: ClassSurface | None, kind: str, name: str, attr: str) -> Any:
    if attr.startswith("__") and attr.endswith("__"):
        return getattr(target, attr)  # the import machinery's own (__spec__, __name__, ...)
    if kind == "module":
        if attr not in rec.surface.exports:
            raise rec.fail(f"mori.io has no {attr!r}")
        rec.used.add(("mori.io", attr))
        value = getattr(target, attr)
        real = rec.surface.export(attr)
        return Spy(value, real, "class", attr, rec) if isinstance(value, type) and real else value
    assert cls is not None, f"{name} is not a class of the real API"
    is_enum = isinstance(target, enum.Enum) or (isinstance(target, type) and issubclass(target, enum.Enum))
    if attr not in cls.members and not (is_enum and attr in ENUM_ATTRS):
        raise rec.fail(f"{cls.name} has no member {attr!r} (it has {', '.join(sorted(cls.members))})")
    rec.used.add((cls.name, attr))
    value = getattr(target, attr)
    if callable(value) and not isinstance(value, (type, enum.Enum)):
        return Spy(value, cls, "method", attr, rec)
    return _wrap(rec, value)


def _check_call(
    rec: Recorder, cls: ClassSurface | None, kind: str, name: str, nargs: int, kw: frozenset[str]
) -> None:
    assert cls is not None
    for key in kw:
        rec.used.add((cls.name, key))
    if kind == "class":
        if cls.layer == "pybind":
            if nargs:
                raise rec.fail(f"{cls.name}(...) got {nargs} positional arguments; pass MoRI's by keyword")
            unknown = sorted(kw - cls.names)
            if unknown:
                raise rec.fail(f"{cls.name}(...) takes no keyword {unknown[0]!r}")
            return
        sig = cls.init
        label = f"{cls.name}(...)"
    else:
        sig = cls.members.get(name)
        label = f"{cls.name}.{name}(...)"
    why = sig.check_call(nargs, kw) if sig is not None else None
    if why:
        raise rec.fail(f"{label} {why}")


def _wrap(rec: Recorder, value: Any) -> Any:
    if isinstance(value, list):
        return [_wrap(rec, v) for v in value]
    real = rec.surface.export(type(value).__name__)  # the layer mori.io takes that name from
    if real is not None and type(value).__module__.startswith("fake_mori"):
        return Spy(value, real, "instance", type(value).__name__, rec)
    return value


def spy_modules(io: types.ModuleType, surface: Surface) -> tuple[Spy, Recorder]:
    """A proxy for the fake ``mori.io`` that checks every use against ``surface``."""
    rec = Recorder(surface)
    return Spy(io, None, "module", "mori.io", rec), rec


# -- the static view ----------------------------------------------------------------------------------


def used_names(path: Path) -> dict[str, list[int]]:
    """Attribute names and call keywords in one file (with ``getattr``/``hasattr`` string names)."""
    found: dict[str, list[int]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
        elif isinstance(node, ast.Call):
            names += [k.arg for k in node.keywords if k.arg]
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("getattr", "hasattr") and len(node.args) >= 2:
                arg = node.args[1]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    names.append(arg.value)
        for name in names:
            found.setdefault(name, []).append(getattr(node, "lineno", 0))
    return found


def _imported_modules(files: tuple[Path, ...]) -> list[Path]:
    """The adapter files and every moriio_ray module they import, transitively."""
    seen: list[Path] = []
    todo = list(files)
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.append(path)
        for node in ast.walk(ast.parse(path.read_text())):
            modules = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moriio_ray"):
                # `from moriio_ray import env` is the module env, not the package's __init__
                subs = [f"{node.module}.{a.name}" for a in node.names]
                modules = [m for m in subs if _module_file(m)] or [node.module]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names if a.name.startswith("moriio_ray")]
            todo += [f for f in map(_module_file, modules) if f is not None]
    return seen


def _module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def own_names(files: tuple[Path, ...]) -> set[str]:
    """Every name that the adapter and the moriio_ray modules it imports define: functions, classes,
    parameters, attributes they assign, fields. (Only those: a name defined elsewhere in the package
    must not hide a MoRI name from this check.)"""
    names: set[str] = set()
    for path in _imported_modules(files):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names


def foreign_names() -> set[str]:
    """What the adapter's other collaborators offer: builtins, the stdlib modules it imports, numpy,
    torch and msgspec (their modules and the types it handles)."""
    import importlib
    import time

    import msgspec
    import numpy as np
    import torch

    objects: list[Any] = [builtins, importlib, threading, time, np, np.ndarray, np.generic, torch]
    objects += [torch.Tensor, torch.device, torch.dtype, msgspec, msgspec.msgpack, msgspec.structs]
    objects += [msgspec.Struct, threading.Event(), threading.Thread, threading.RLock(), threading.Lock()]
    objects += [str, bytes, list, dict, tuple, set, frozenset, int, float, bool, BaseException, type]
    objects += [types.ModuleType]
    names: set[str] = set()
    for obj in objects:
        names |= set(dir(obj))
    # keyword names of the small stdlib callables it may call (numpy/torch: the adapter passes none)
    for obj in [threading, time, importlib, threading.Lock(), threading.Event(), threading.Thread]:
        for attr in dir(obj):
            try:
                names |= set(inspect.signature(getattr(obj, attr)).parameters)
            except (TypeError, ValueError):
                continue
    return names | {"blocking", "timeout"}  # lock.acquire's, which inspect cannot read (a builtin)


def adapter_names(files: tuple[Path, ...] = ADAPTER_FILES) -> dict[str, list[str]]:
    """Names in the adapter that only ``mori.io`` can explain: name -> ["mori.py:123", ...]."""
    explained = own_names(ADAPTER_FILES) | foreign_names()
    left: dict[str, list[str]] = {}
    for path in files:
        for name, lines in used_names(path).items():
            if name not in explained:
                left.setdefault(name, []).extend(f"{path.name}:{n}" for n in lines)
    return left


def unreal_or_unexercised(
    surface: Surface, rec: Recorder, left: dict[str, list[str]], *, check_reached: bool = True
) -> list[str]:
    """Why each name the adapter leaves to MoRI is wrong: not in the real API, or (with
    ``check_reached``) never checked by the spy."""
    real = surface.all_names()
    problems = []
    for name, where in sorted(left.items()):
        if name not in real:
            problems.append(f"{name!r} ({', '.join(where)}) is not a name of amd-mori {surface.version}")
        elif check_reached and name not in rec.names():
            problems.append(
                f"{name!r} ({', '.join(where)}) is a MoRI name that no surface scenario reached; add one "
                "to tests/unit/test_mori_surface.py so that its class and arity get checked"
            )
    return problems
