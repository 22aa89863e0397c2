"""The mori adapter and the fake ``mori`` against the API of the real amd-mori 1.2.4 wheel.

The wheel is fetched once into a cache outside the tree (``tests/unit/mori_wheel.py``) and read,
not imported: it needs ROCm's runtime. Without the package index and without a cached copy, these
tests skip with the reason. What is read, and how: ``tests/unit/mori_surface.py``; how the adapter's
use is checked: ``tests/unit/mori_usage.py``.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import sys
from typing import Any

import fake_mori  # tests/unit is on sys.path under pytest (no __init__.py here)
import mori_usage
import mori_wheel
import pytest
import torch
from mori_surface import ClassSurface, Signature, Surface, read_surface

from moriio_ray.errors import PeerLost, TransferError
from moriio_ray.transfer.mori_status import MAPPED_STATUS_CODES
from moriio_ray.transfer.plan import TransferPlan

pytestmark = pytest.mark.timeout(240)  # the first test may download the wheel (10 MB)


@pytest.fixture(scope="module")
def surface() -> Surface:
    try:
        wheel = mori_wheel.wheel_path()
    except mori_wheel.WheelUnavailable as exc:
        pytest.skip(f"the real amd-mori {mori_wheel.VERSION} wheel is not here and cannot be fetched: {exc}")
    sources = mori_wheel.read_sources(wheel)
    return read_surface(mori_wheel.VERSION, sources, mori_wheel.read_member(wheel, mori_wheel.PYBIND_MEMBER))


# -- what the wheel says (so that the checks below cannot pass on an empty reading) ---------------------


def test_the_wheel_reads_as_amd_mori_1_2_4(surface):
    assert surface.exports["IOEngine"] == "python" and surface.exports["RdmaBackendConfig"] == "pybind"
    assert "TransferStatus" not in surface.exports  # mori.io does not re-export it
    session, engine = surface.python["IOEngineSession"], surface.python["IOEngine"]
    assert session.members["batch_read"] == Signature(
        ("local_offsets", "remote_offsets", "sizes", "transfer_uid"), 4
    )
    assert session.members["alive"] == Signature((), 0)
    assert engine.members["wait_all"] == Signature(("statuses", "timeout_ms"), 1)
    assert engine.members["pop_peer_failure"] == Signature((), 0)
    assert engine.init == Signature(("key", "config"), 2)
    pybind = surface.pybind
    assert len(pybind) >= 15
    assert pybind["TransferStatus"].members["Succeeded"] == Signature((), 0)
    assert pybind["EngineDesc"].members["unpack"] == Signature((None,), 1)
    assert set(pybind["StatusCode"].members) == {
        "SUCCESS", "INIT", "IN_PROGRESS", "ERR_INVALID_ARGS", "ERR_NOT_FOUND", "ERR_RDMA_OP",
        "ERR_BAD_STATE", "ERR_GPU_OP",
    }  # fmt: skip
    assert {"qp_per_transfer", "num_worker_threads", "enable_notification"} <= pybind[
        "RdmaBackendConfig"
    ].names
    assert set(pybind["PeerFailureEvent"].members) == {
        "remote_engine_key", "reason", "qp_num", "port_num", "device_name", "detail",
    }  # fmt: skip
    assert "PEER_UNREACHABLE" in pybind["PeerFailureReason"].members


# -- the fake offers nothing that the real mori lacks --------------------------------------------------


def _fake_signature(func: Any, *, bound: bool) -> Signature:
    params = list(inspect.signature(func).parameters.values())[1 if bound else 0 :]
    names = tuple(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    required = sum(1 for p in params if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD)
    return Signature(names, required)


def _same_shape(fake: Signature, real: Signature) -> bool:
    if len(fake.params) != len(real.params) or (real.required is not None and fake.required != real.required):
        return False
    return all(r is None or f == r for f, r in zip(fake.params, real.params, strict=True))


def _class_problems(label: str, fake: type, real: ClassSurface) -> list[str]:
    if issubclass(fake, enum.Enum):
        return [
            f"{label}.{m} is not a member of the real enum" for m in fake.__members__ if m not in real.members
        ]
    problems = []
    fields = {f.name for f in dataclasses.fields(fake)} if dataclasses.is_dataclass(fake) else set()
    for name in fields - set(real.members):
        problems.append(f"{label}.{name} is not a field of the real {real.name}")
    own = [c for c in fake.__mro__ if c.__module__ == fake.__module__]
    for name, value in {k: v for c in reversed(own) for k, v in vars(c).items()}.items():
        if name.startswith("_") or name in fields:
            continue
        if name not in real.members:
            problems.append(f"{label}.{name} is not in the real {real.name}")
            continue
        real_sig = real.members[name]
        if real_sig is not None and callable(getattr(fake, name)):
            fake_sig = _fake_signature(getattr(fake, name), bound=not isinstance(value, staticmethod))
            if not _same_shape(fake_sig, real_sig):
                problems.append(
                    f"{label}.{name}{fake_sig.describe()} differs from the real {real_sig.describe()}"
                )
    init = _fake_signature(fake.__init__, bound=True) if "__init__" in vars(fake) or fields else None
    if init is not None and real.layer == "python" and real.init and not _same_shape(init, real.init):
        problems.append(f"{label}{init.describe()} differs from the real {real.name}{real.init.describe()}")
    if init is not None and real.layer == "pybind" and not set(init.params) <= real.names:
        problems.append(f"{label}{init.describe()} takes keywords the real {real.name} lacks")
    return problems


def _samples(fabric: fake_mori.Fabric) -> list[Any]:
    """One object of each kind the fake hands out."""
    engine = fake_mori.IOEngine("sample", fake_mori.IOEngineConfig(host="127.0.0.1", port=0))
    engine.create_backend(fake_mori.BackendType.RDMA, fake_mori.RdmaBackendConfig())
    mem = engine.register_torch_tensor(torch.zeros(8, dtype=torch.uint8))
    engine.register_remote_engine(engine.get_engine_desc())
    session = engine.create_session(mem, mem)
    status = session.batch_read([0], [0], [4], session.allocate_transfer_uid())
    fabric.fail_peer("sample")
    event = engine.pop_peer_failure()
    configs = [fake_mori.XgmiBackendConfig(), fake_mori.IOEngineConfig(), fake_mori.RdmaBackendConfig()]
    return [engine, session, status, mem, engine.get_engine_desc(), event, *configs]


def test_the_fake_offers_nothing_the_real_mori_lacks(surface, monkeypatch):
    fabric = fake_mori.install(monkeypatch)
    _, io, cpp = fake_mori.build_modules()
    problems: list[str] = []
    for name in [n for n in vars(io) if not n.startswith("__")]:
        real = surface.export(name)
        if name not in surface.exports or real is None:
            problems.append(f"fake mori.io.{name} is not a class that the real mori.io exports")
        else:
            problems += _class_problems(f"fake mori.io.{name}", getattr(io, name), real)
    for name in [n for n in vars(cpp) if not n.startswith("__")]:
        if name not in surface.pybind:
            problems.append(f"fake mori.cpp.{name} is not a pybind class of the real mori")
        else:
            problems += _class_problems(f"fake mori.cpp.{name}", getattr(cpp, name), surface.pybind[name])
    for obj in _samples(fabric):
        real = surface.export(type(obj).__name__)
        assert real is not None, type(obj)
        for attr in [a for a in vars(obj) if not a.startswith("_")]:
            if attr not in real.members:
                problems.append(f"a fake {type(obj).__name__} carries {attr!r}, which the real one lacks")
    assert problems == []


# -- the adapter uses only the real surface ------------------------------------------------------------


def _scenarios(fabric: fake_mori.Fabric) -> None:
    """Drive every path of the adapter that touches mori.io."""
    d = fake_mori.make_agent("decode-0", poll_cq_mode="polling")
    p = fake_mori.make_agent("prefill-0", poll_cq_mode="event", enable_notification=True)
    fake_mori.make_agent("xgmi-0", backend="xgmi").close()
    d.connect(p.engine_desc())
    src = p.register(torch.arange(256, dtype=torch.uint8))
    dst = d.register(torch.zeros(256, dtype=torch.uint8))
    x = d.read(dst, src, TransferPlan([0, 100], [10, 200], [20, 30]))
    with pytest.raises(TransferError):
        x.wait(timeout_s=0.06)  # still running: waits through wait_all
    fabric.complete()
    x.wait(timeout_s=5.0)
    p.connect(d.engine_desc())
    w = p.write(src, dst, TransferPlan([0], [0], [16]))
    fabric.complete()
    w.wait(timeout_s=5.0)
    fabric.fail_next = (fake_mori.StatusCode.ERR_RDMA_OP, "injected")
    with pytest.raises(TransferError, match="ERR_RDMA_OP"):
        d.read(dst, src, TransferPlan([0], [0], [8])).wait(timeout_s=1.0)
    y = d.read(dst, src, TransferPlan([0], [0], [8]))
    fabric.fail_peer(p.mori_key)
    with pytest.raises(PeerLost):
        y.wait(timeout_s=5.0)
    with pytest.raises(PeerLost):
        d.read(dst, src, TransferPlan([0], [0], [8]))  # the fresh session is not alive
    q = fake_mori.make_agent("prefill-1")
    d.connect(q.engine_desc())
    z = d.read(dst, q.register(torch.zeros(64, dtype=torch.uint8)), TransferPlan([0], [0], [8]))
    local = fake_mori.PeerFailureEvent("", fake_mori.PeerFailureReason.LOCAL_QP_ERROR, 1, 1, "rdma0", "qp")
    fabric.push_failure(d.mori_key, local)
    with pytest.raises(TransferError, match="LOCAL_QP_ERROR"):
        z.wait(timeout_s=5.0)
    d.deregister(dst)
    d.disconnect(p.key)
    fabric.complete()
    for agent in (d, p, q):
        agent.close()


@pytest.fixture(scope="module")
def exercised(surface: Surface) -> mori_usage.Recorder:
    """The scenarios, run with the adapter seeing the fake only through a spy of the real surface."""
    with pytest.MonkeyPatch.context() as mp:
        fabric = fake_mori.install(mp, immediate=False)
        spy, rec = mori_usage.spy_modules(sys.modules["mori.io"], surface)
        mp.setitem(sys.modules, "mori.io", spy)
        try:
            _scenarios(fabric)
        except mori_usage.SurfaceMismatch:
            pass  # recorded in rec.errors, reported by the tests
    return rec


def test_the_adapter_calls_only_what_the_real_mori_has(exercised):
    assert exercised.errors == []
    assert len(exercised.used) >= 40  # the scenarios reached the adapter's MoRI calls at all


def test_the_status_codes_mapped_to_our_errors_are_real(surface):
    assert MAPPED_STATUS_CODES <= set(surface.pybind["StatusCode"].members)
    assert {"ERR_NOT_FOUND", "ERR_INVALID_ARGS", "ERR_RDMA_OP"} <= MAPPED_STATUS_CODES


def test_every_mori_name_in_the_adapter_is_real_and_was_checked(surface, exercised):
    left = mori_usage.adapter_names()
    assert {"batch_read", "pop_peer_failure", "wait_all", "RdmaBackendConfig"} <= set(left)
    # Once the scenarios stopped at a mismatch (the test above), names they never reached say nothing.
    reached = not exercised.errors
    assert mori_usage.unreal_or_unexercised(surface, exercised, left, check_reached=reached) == []


# -- the checks can fail ---------------------------------------------------------------------------------


def test_the_checks_catch_a_misspelt_call(surface, monkeypatch, tmp_path):
    fake_mori.install(monkeypatch)
    spy, rec = mori_usage.spy_modules(sys.modules["mori.io"], surface)
    with pytest.raises(mori_usage.SurfaceMismatch, match="no member 'RDAM'"):
        spy.BackendType.RDAM  # noqa: B018
    with pytest.raises(mori_usage.SurfaceMismatch, match="no keyword 'num_worker_thread'"):
        spy.RdmaBackendConfig(num_worker_thread=1)
    engine = spy.IOEngine("k", spy.IOEngineConfig(host="127.0.0.1", port=0))
    with pytest.raises(mori_usage.SurfaceMismatch, match="has no parameter 'timeout'"):
        engine.wait_all([], timeout=5)
    with pytest.raises(mori_usage.SurfaceMismatch, match="no member 'pop_peer_failures'"):
        engine.pop_peer_failures()
    assert len(rec.errors) == 4
    source = tmp_path / "misspelt.py"
    source.write_text("def issue(session, lo):\n    return session.batch_reed(lo, lo, lo, 1)\n")
    left = mori_usage.adapter_names((source,))
    assert mori_usage.unreal_or_unexercised(surface, rec, left) == [
        "'batch_reed' (misspelt.py:2) is not a name of amd-mori 1.2.4"
    ]


def test_the_fake_check_catches_drift(surface):
    class Drifted(fake_mori.IOEngineSession):
        def batch_reed(self, local_offsets, remote_offsets, sizes, transfer_uid):
            raise NotImplementedError

        def alive(self, now):
            raise NotImplementedError

    class Backends(enum.Enum):
        RDMA = 2
        INFINIBAND = 9

    assert set(_class_problems("Drifted", Drifted, surface.python["IOEngineSession"])) == {
        "Drifted.batch_reed is not in the real IOEngineSession",
        "Drifted.alive(now) differs from the real ()",
    }
    assert _class_problems("Backends", Backends, surface.pybind["BackendType"]) == [
        "Backends.INFINIBAND is not a member of the real enum"
    ]
