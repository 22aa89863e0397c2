"""Without ``mori`` the mori backend fails with a clear error, and nothing else ever imports ``mori``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from moriio_ray.config import TransferConfig
from moriio_ray.errors import BackendUnavailable
from moriio_ray.transfer import create_agent


@pytest.mark.timeout(10)
def test_choosing_mori_without_mori_says_how_to_install_it(monkeypatch):
    # A None entry makes `import mori` fail as it does on a host without amd-mori.
    monkeypatch.setitem(sys.modules, "mori", None)
    monkeypatch.setitem(sys.modules, "mori.io", None)
    with pytest.raises(BackendUnavailable) as info:
        create_agent(TransferConfig(backend="mori"), key="decode-0")
    message = str(info.value)
    assert "amd-mori" in message and "ROCm" in message and "transfer.backend" in message


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("cls", "method"),
    [("IOEngine", "wait_all"), ("IOEngine", "pop_peer_failure"), ("IOEngineSession", "alive")],
)
def test_a_mori_older_than_1_2_4_is_refused_by_name(monkeypatch, cls, method):
    import fake_mori  # tests/unit is on sys.path under pytest (no __init__.py here)

    fake_mori.install(monkeypatch)
    monkeypatch.delattr(getattr(fake_mori, cls), method)
    with pytest.raises(BackendUnavailable, match=rf"no {cls}\.{method}.*amd-mori>=1\.2\.4"):
        create_agent(TransferConfig(backend="mori"), key="decode-0")


_PROBE = textwrap.dedent(
    """
    import importlib, sys
    import moriio_ray
    from moriio_ray.transfer import agent_class, create_agent, TransferConfig
    assert "mori" not in sys.modules, "import moriio_ray imported mori"
    agent_class("mori")  # the adapter module itself must import without mori
    assert "mori" not in sys.modules, "importing moriio_ray.transfer.mori imported mori"
    made = []
    for backend in ("tcp", "shm"):
        try:
            importlib.import_module(f"moriio_ray.transfer.{backend}")
        except ModuleNotFoundError as exc:
            if exc.name != f"moriio_ray.transfer.{backend}":
                raise
            continue  # that backend is not in this checkout yet
        create_agent(TransferConfig(backend=backend), key=f"probe-{backend}").close()
        made.append(backend)
    assert "mori" not in sys.modules, "creating a non-mori agent imported mori"
    print("made:" + ",".join(made))
    """
)


@pytest.mark.timeout(60)
def test_import_moriio_ray_and_other_backends_never_import_mori():
    # A fresh interpreter: in this one, other tests put a fake mori into sys.modules.
    result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr
    assert "made:" in result.stdout
