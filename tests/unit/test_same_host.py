"""Same-host backends compare the machine id, not the IP (which differs inside and outside Ray)."""

from __future__ import annotations

import msgspec
import pytest

from moriio_ray.config import TransferConfig
from moriio_ray.errors import IncompatiblePeer
from moriio_ray.transfer import create_agent
from moriio_ray.transfer.netinfo import machine_id


@pytest.mark.timeout(20)
def test_shm_accepts_this_machine_under_another_ip_and_refuses_another_machine() -> None:
    with (
        create_agent(TransferConfig(backend="shm"), "a") as a,
        create_agent(TransferConfig(backend="shm"), "b") as b,
    ):
        desc = b.engine_desc()
        assert desc.machine_id == machine_id() != ""
        a.connect(msgspec.structs.replace(desc, host="192.0.2.99"))  # the Ray node IP, same machine
        assert "b" in a.peers()
        other = msgspec.structs.replace(desc, key="c", machine_id="elsewhere/boot")
        with pytest.raises(IncompatiblePeer, match="reaches only this host"):
            a.connect(other)
        assert "c" not in a.peers()
