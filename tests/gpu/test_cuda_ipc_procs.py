"""cuda_ipc across processes (real IPC handles): two GPUs in two processes, two processes on one GPU.

The peer is a child process (``cuda_ipc_peer.serve``) with its own agent and registered region.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from cuda_ipc_peer import Peer, apply, pattern, random_segments

from moriio_ray.errors import PeerLost
from moriio_ray.transfer import TransferConfig, create_agent
from moriio_ray.transfer.plan import TransferPlan

torch = pytest.importorskip("torch")

REGION_BYTES = 8 << 20
HARNESSES = [
    pytest.param((0, 0), id="one-gpu-two-procs", marks=pytest.mark.gpu),
    pytest.param((0, 1), id="two-gpus-two-procs", marks=pytest.mark.gpu(min_gpus=2)),
]


class Local:
    def __init__(self, device: int) -> None:
        torch.cuda.set_device(device)
        self.agent: Any = create_agent(TransferConfig(backend="cuda_ipc"), "local")  # takes after=
        self.device = torch.device("cuda", device)
        self.host = pattern(REGION_BYTES, 11)
        self.region = self.agent.allocate((REGION_BYTES,), torch.uint8, self.device)
        self.region.copy_(torch.from_numpy(self.host))
        self.mem = self.agent.register(self.region)

    def bytes(self) -> np.ndarray:
        torch.cuda.synchronize(self.device)
        return self.region.cpu().numpy()


@pytest.fixture(params=HARNESSES)
def procs(request: pytest.FixtureRequest) -> Iterator[tuple[Local, Peer]]:
    local_dev, peer_dev = request.param
    peer = Peer("remote", peer_dev, REGION_BYTES, 22)
    local = Local(local_dev)
    local.agent.connect(peer.desc)
    yield local, peer
    local.agent.close()
    peer.stop()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["kernel", "copy_engine", "memcpy"])
def test_read_and_write_thousand_random_segments_through_ipc(procs: tuple[Local, Peer], method: str) -> None:
    local, peer = procs
    local.agent.tune(method=method)  # IPC-mapped memory, through each way the agent can copy
    remote_host = pattern(REGION_BYTES, 22)
    rng = np.random.default_rng(5)
    dst, src, sizes = random_segments(rng, 1000, REGION_BYTES, REGION_BYTES, 5000)
    # read: the local GPU pulls from the peer's memory
    expect_local = local.host.copy()
    apply(expect_local, remote_host, dst, src, sizes)
    local.agent.read(local.mem, peer.mem, TransferPlan(dst, src, sizes)).wait(timeout_s=30)
    assert np.array_equal(local.bytes(), expect_local)
    # write: the local GPU pushes into the peer's memory
    dst2, src2, sizes2 = random_segments(np.random.default_rng(6), 1000, REGION_BYTES, REGION_BYTES, 5000)
    expect_remote = remote_host.copy()
    apply(expect_remote, expect_local, dst2, src2, sizes2)
    local.agent.write(local.mem, peer.mem, TransferPlan(src2, dst2, sizes2)).wait(timeout_s=30)
    got = peer.dump()
    bad = np.flatnonzero(got != expect_remote)
    assert bad.size == 0, f"{bad.size} bytes differ in the peer, first at {bad[:5]}"


@pytest.mark.timeout(180)
def test_peer_killed_fails_new_and_in_flight_transfers_with_peer_lost(procs: tuple[Local, Peer]) -> None:
    local, peer = procs
    seg = TransferPlan([0], [0], [4096])
    local.agent.read(local.mem, peer.mem, seg).wait(timeout_s=30)
    # in flight: the copy waits on a long kernel of the local GPU while the peer dies
    side = torch.cuda.Stream(device=local.device)
    with torch.cuda.device(local.device), torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000_000)
        gate = torch.cuda.Event()
        gate.record(side)
    x = local.agent.read(local.mem, peer.mem, seg, after=gate)
    peer.kill()
    with pytest.raises(PeerLost):
        x.wait(timeout_s=20)
    assert x.done() and isinstance(x.error(), PeerLost)
    with pytest.raises(PeerLost):
        local.agent.read(local.mem, peer.mem, seg)
    local.agent.disconnect(peer.desc.key)  # waits for the gated copy before unmapping
    with pytest.raises(PeerLost, match="not connected"):
        local.agent.read(local.mem, peer.mem, seg)
