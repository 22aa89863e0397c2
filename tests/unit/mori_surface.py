"""The API surface of a real ``mori.io``, read from its wheel without importing it.

Two layers, read two ways:

- **Python** (``mori/io/*.py``, with ``ast``): what ``mori.io`` exports, and the classes written in
  Python (``IOEngine``, ``IOEngineSession``) with each method's parameters. A ``def f(self, *args)``
  that only forwards ``*args`` to another method gets that method's parameters.
- **pybind** (``libmori_pybinds.so``): the names that ``mori::RegisterMoriIo`` hands to pybind11,
  in the order it registers them. They are the string-table entries that its machine code loads
  (``lea`` relative to the instruction pointer), so each class name is followed by its own members:
  enum values, fields, methods and keyword names. A method's arity comes from the signature text
  that pybind11 stores next to its name (``({%}, {int}) -> None``: self and one argument). Default
  values are not in the binary, so a pybind method's required count is unknown.
"""

from __future__ import annotations

import ast
import re
import struct
from dataclasses import dataclass, field

PYBIND_INIT = "_ZN4mori14RegisterMoriIoERN8pybind117module_E"  # mori::RegisterMoriIo(pybind11::module_&)
_TYPEINFO_NAME = re.compile(r"_ZTSN4mori2io(\d+)(\w+)")  # typeinfo name of a mori::io type
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_SIGNATURE = re.compile(r"\((.*)\) -> ")
ENUM_ATTRS = frozenset({"name", "value"})  # what every pybind11 enum member has


@dataclass(frozen=True)
class Signature:
    """Parameters after ``self``. A None name is positional-only (pybind without ``py::arg``)."""

    params: tuple[str | None, ...]
    required: int | None  # None: unknown (pybind keeps no defaults in the binary)
    varargs: bool = False

    def check_call(self, num_args: int, kwargs: frozenset[str]) -> str | None:
        """Why a call with ``num_args`` positional arguments and ``kwargs`` would fail, or None."""
        if self.varargs:
            return None
        if num_args > len(self.params):
            return f"takes at most {len(self.params)} positional arguments, got {num_args}"
        for name in sorted(kwargs):
            if name not in self.params:
                return f"has no parameter {name!r} (it takes {self.describe()})"
            if self.params.index(name) < num_args:
                return f"got {name!r} both by position and by keyword"
        filled = num_args + len(kwargs)
        if self.required is not None and filled < self.required:
            return f"needs {self.required} arguments ({self.describe()}), got {filled}"
        return None

    def describe(self) -> str:
        names = [p or "_" for p in self.params]
        return "(" + ", ".join(names) + ")"


@dataclass
class ClassSurface:
    """One class of the real API: its members (None for a field or enum value) and every name in its
    registration (members and keyword names; for a pybind class, its constructor's keywords)."""

    name: str
    layer: str  # "python" or "pybind"
    members: dict[str, Signature | None] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)
    init: Signature | None = None


@dataclass
class Surface:
    version: str
    exports: dict[str, str]  # mori.io name -> "python" or "pybind"
    python: dict[str, ClassSurface]
    pybind: dict[str, ClassSurface]

    def export(self, name: str) -> ClassSurface | None:
        """The class ``mori.io.<name>`` is, in the layer it comes from (None for a non-class)."""
        table = self.python if self.exports.get(name) == "python" else self.pybind
        return table.get(name)

    def all_names(self) -> set[str]:
        found = set(self.exports) | ENUM_ATTRS
        for cls in [*self.python.values(), *self.pybind.values()]:
            found |= cls.names | set(cls.members)
        return found


# -- the Python layer -------------------------------------------------------------------------------


def python_surface(sources: dict[str, str]) -> tuple[dict[str, str], dict[str, ClassSurface]]:
    """(exports of mori.io, the classes written in Python) from ``mori/io/*.py``."""
    modules = {path.rsplit("/", 1)[-1][:-3]: ast.parse(text) for path, text in sources.items()}
    classes: dict[str, ClassSurface] = {}
    for tree in modules.values():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                classes[node.name] = _python_class(node)
    exports: dict[str, str] = {}
    for node in modules["__init__"].body:  # in order: a later import shadows an earlier one
        if not isinstance(node, ast.ImportFrom):
            continue
        layer = "pybind" if node.module == "mori.cpp" else "python"
        for alias in node.names:
            if alias.name == "*" and node.level == 1 and node.module in modules:
                for name in _public_names(modules[node.module]):
                    exports[name] = layer
            else:
                exports[alias.asname or alias.name] = layer
    return exports, classes


def _public_names(tree: ast.Module) -> list[str]:
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names += [(a.asname or a.name).split(".")[0] for a in node.names]
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
    return [n for n in names if not n.startswith("_")]


def _python_class(node: ast.ClassDef) -> ClassSurface:
    defs = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
    cls = ClassSurface(node.name, "python")
    for name, func in defs.items():
        sig = _forwarded(func, defs) or _signature(func)
        if name == "__init__":
            cls.init = sig
        elif not name.startswith("_"):
            cls.members[name] = sig
        cls.names |= {p for p in sig.params if p}
    cls.names |= set(cls.members)
    return cls


def _signature(func: ast.FunctionDef) -> Signature:
    args = [*func.args.posonlyargs, *func.args.args][1:]  # drop self
    params = tuple(a.arg for a in args) + tuple(a.arg for a in func.args.kwonlyargs)
    required = len(args) - len(func.args.defaults)
    return Signature(params, required, varargs=func.args.vararg is not None)


def _forwarded(func: ast.FunctionDef, defs: dict[str, ast.FunctionDef]) -> Signature | None:
    """``def read(self, *args): return self._helper(x, *args)`` takes ``_helper``'s parameters after x."""
    own = func.args
    if own.vararg is None or len(own.args) != 1 or len(func.body) != 1:
        return None
    body = func.body[0]
    if not (isinstance(body, ast.Return) and isinstance(body.value, ast.Call)):
        return None
    call = body.value
    target = call.func
    if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)):
        return None
    if target.value.id != "self" or target.attr not in defs or not call.args:
        return None
    last = call.args[-1]
    if not (isinstance(last, ast.Starred) and isinstance(last.value, ast.Name)):
        return None
    if last.value.id != own.vararg.arg:
        return None
    inner = _signature(defs[target.attr])
    skip = len(call.args) - 1
    return Signature(inner.params[skip:], max(0, (inner.required or 0) - skip), inner.varargs)


# -- the pybind layer -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Section:
    addr: int
    offset: int
    size: int


def _sections(elf: bytes) -> dict[str, _Section]:
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a little-endian 64-bit ELF file")
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    found = {}
    for name_off, _type, _flags, addr, offset, size in headers:
        name = elf[names_at + name_off : elf.index(b"\0", names_at + name_off)].decode()
        found[name] = _Section(addr, offset, size)
    return found


def _symbols(elf: bytes, secs: dict[str, _Section]) -> dict[str, tuple[int, int]]:
    """name -> (address, size), from .symtab and .dynsym."""
    table: dict[str, tuple[int, int]] = {}
    for symtab, strtab in ((".dynsym", ".dynstr"), (".symtab", ".strtab")):
        if symtab not in secs or strtab not in secs:
            continue
        sym, names = secs[symtab], secs[strtab].offset
        for off in range(sym.offset, sym.offset + sym.size, 24):
            name_off, _info, _other, _shndx, value, size = struct.unpack_from("<IBBHQQ", elf, off)
            if name_off:
                name = elf[names + name_off : elf.index(b"\0", names + name_off)]
                table[name.decode(errors="replace")] = (value, size)
    return table


def _vaddr_to_offset(secs: dict[str, _Section], addr: int) -> int:
    for sec in secs.values():
        if sec.addr and sec.addr <= addr < sec.addr + sec.size:
            return sec.offset + addr - sec.addr
    raise ValueError(f"address {addr:#x} lies in no section")


def registration_strings(elf: bytes) -> list[str]:
    """The .rodata strings that ``RegisterMoriIo`` loads, in code order."""
    secs = _sections(elf)
    symbols = _symbols(elf, secs)
    if PYBIND_INIT not in symbols:
        raise ValueError(f"{PYBIND_INIT} is not in the symbol table")
    start, size = symbols[PYBIND_INIT]
    code_at = _vaddr_to_offset(secs, start)
    code = elf[code_at : code_at + size]
    rodata = secs[".rodata"]
    found = []
    # lea disp32(%rip), %reg: REX.W (0x48, or 0x4c for r8-r15), 0x8d, ModRM with mod=00 rm=101.
    for i in range(len(code) - 6):
        if code[i] not in (0x48, 0x4C) or code[i + 1] != 0x8D or code[i + 2] & 0xC7 != 0x05:
            continue
        (disp,) = struct.unpack_from("<i", code, i + 3)
        target = start + i + 7 + disp
        if not rodata.addr <= target < rodata.addr + rodata.size:
            continue
        at = rodata.offset + target - rodata.addr
        if target != rodata.addr and elf[at - 1] != 0:
            continue  # the middle of a string: not a literal this code names
        text = elf[at : elf.index(b"\0", at)]
        if text and all(32 <= c < 127 for c in text):
            found.append(text.decode())
    return found


def pybind_classes(elf: bytes) -> dict[str, ClassSurface]:
    """Each mori::io class or enum that pybind registers, with the names registered after it.

    pybind11 loads a method's name, its signature text and the name again (``Code``, ``({%}) -> %``,
    ``Code``); a static method's signature is followed by ``__name__`` or by the next class; a
    property's getter signature comes before the property's own name, and says nothing about a call.
    """
    class_names = {m.group(2)[: int(m.group(1))] for m in map(_TYPEINFO_NAME.match, _symbols_of(elf)) if m}
    strings = registration_strings(elf)
    classes: dict[str, ClassSurface] = {}
    current: ClassSurface | None = None
    for i, text in enumerate(strings):
        if _IDENTIFIER.match(text):
            if text in class_names and text not in classes:
                current = classes[text] = ClassSurface(text, "pybind")
            elif current is not None and text != "__name__":
                current.names.add(text)
                current.members.setdefault(text, None)
            continue
        sig = _SIGNATURE.match(text)
        if not sig or current is None or not 0 < i < len(strings) - 1:
            continue
        name, after = strings[i - 1], strings[i + 1]
        static = after == "__name__" or after in class_names
        if name in current.members and (after == name or static):
            groups = re.findall(r"\{[^{}]*\}", sig.group(1))
            has_self = not static and bool(groups) and groups[0] == "{%}"
            arity = len(groups) - (1 if has_self else 0)
            current.members[name] = Signature((None,) * arity, arity)
    return classes


def _symbols_of(elf: bytes) -> list[str]:
    return list(_symbols(elf, _sections(elf)))


def read_surface(version: str, sources: dict[str, str], pybind_elf: bytes) -> Surface:
    exports, python = python_surface(sources)
    return Surface(version, exports, python, pybind_classes(pybind_elf))
