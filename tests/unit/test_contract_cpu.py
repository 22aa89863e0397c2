"""The contract suite for the CPU backends, tcp and shm, plus what is specific to each of them.

tcp also runs the whole suite through its GPU staging path forced onto CPU memory (``tcp-staged``)
and, where CUDA is present, with its regions in GPU memory (``tcp-cuda``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from moriio_ray.config import TcpConfig
from moriio_ray.errors import BackendUnavailable, ConfigError
from moriio_ray.transfer.plan import TransferPlan
from moriio_ray.transfer.shm import sweep_stale_segments
from moriio_ray.transfer.shm_segment import SHM_DIR
from tests.contract.harness import Harness, pattern
from tests.contract.suite import ContractSuite, MiB, finish, host, pair, random_offsets_for


class TcpHarness(Harness):
    backend = "tcp"
    token_applies = True
    can_pause_peer = True
    hold_side = "peer"  # the peer's server parks mid-send


class ShmHarness(Harness):
    backend = "shm"
    hold_side = "client"  # the caller's copy parks between chunks


class TcpStagedHarness(TcpHarness):
    """tcp through its GPU staging path, forced onto CPU memory in this process.

    Default 64 MiB windows: a whole BIG transfer is one window (the test with 1 MiB windows is below).
    """

    staged = True


class TcpCudaHarness(TcpHarness):
    """tcp with the regions in GPU memory: the pinned staging path, where CUDA is present."""

    device = "cuda:0"


_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="tcp over GPU memory needs CUDA")


@pytest.fixture(
    params=[
        TcpHarness,
        ShmHarness,
        TcpStagedHarness,
        pytest.param(TcpCudaHarness, marks=[pytest.mark.gpu, _NO_CUDA]),
    ],
    ids=["tcp", "shm", "tcp-staged", "tcp-cuda"],
)
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    with request.param() as h:
        yield h


class TestContractCpu(ContractSuite):
    """tcp and shm pass the whole contract."""


# -- tcp only ------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("uniform", [True, False], ids=["equal-rows", "split-pieces"])
def test_tcp_staged_path_moves_the_same_bytes(uniform: bool) -> None:
    """The GPU staging path (windows, gathers, scatters), forced onto CPU memory with 1 MiB windows.

    Equal aligned segments take the one-gather path; random sizes are split across windows.
    """
    with TcpStagedHarness() as h:
        a = h.make_agent("decode-0", tcp=TcpConfig(staging_bytes=MiB))
        b = h.make_agent("prefill-0", tcp=TcpConfig(staging_bytes=MiB))
        ta, ma = h.region(a, 4 * MiB)
        tb, mb = h.region(b, 4 * MiB, seed=1)
        a.connect(b.engine_desc())
        rng = np.random.default_rng(5)
        if uniform:
            sz = np.full(700, 4096, dtype=np.int64)
            lo, ro = (rng.permutation(1024)[:700].astype(np.int64) * 4096 for _ in range(2))
        else:
            sz = rng.integers(1, 300_000, 20).astype(np.int64)
            lo, ro = random_offsets_for(rng, sz, 4 * MiB), random_offsets_for(rng, sz, 4 * MiB)
        finish(a.read(ma, mb, TransferPlan(lo, ro, sz)))
        remote, local = pattern(1, 4 * MiB), pattern(9, 4 * MiB)  # b's region; what a writes next
        ref = np.zeros(4 * MiB, np.uint8)
        for d, s, n in zip(lo.tolist(), ro.tolist(), sz.tolist(), strict=True):
            ref[d : d + n] = remote[s : s + n]
        assert np.array_equal(host(ta), ref)
        ta.copy_(torch.from_numpy(local))
        finish(a.write(ma, mb, TransferPlan(lo, ro, sz)))
        ref = remote.copy()
        for d, s, n in zip(lo.tolist(), ro.tolist(), sz.tolist(), strict=True):
            ref[s : s + n] = local[d : d + n]
        assert np.array_equal(host(tb), ref)


@pytest.mark.timeout(30)
def test_tcp_reuses_pooled_connections() -> None:
    with TcpHarness() as h:
        a, b, _, ma, _, mb = pair(h, MiB)
        for _ in range(20):
            finish(a.read(ma, mb, TransferPlan([0], [0], [4096])))
        served = b._server._conns  # type: ignore[attr-defined]
        assert 1 <= len(served) <= 4  # one hello per pooled connection, not one per request


# -- shm only ------------------------------------------------------------------------------------


def _segments_of(pid: int) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"moriio-{pid}-*"))


@pytest.mark.timeout(30)
def test_shm_register_accepts_only_its_own_shared_memory() -> None:
    with ShmHarness() as h:
        a = h.make_agent("decode-0")
        with pytest.raises(ConfigError, match=r"allocate through agent\.allocate"):
            a.register(torch.zeros(4096, dtype=torch.uint8))
        other = h.make_agent("other")
        with pytest.raises(ConfigError, match=r"allocate through agent\.allocate"):
            a.register(other.allocate((4096,), torch.uint8, "cpu"))
        kv = a.allocate((8, 1024), torch.float16, "cpu")
        mem = a.register(kv[2:4])  # a slice inside the allocation is fine
        assert mem.num_bytes == 2 * 1024 * 2


@pytest.mark.timeout(30)
def test_shm_close_unlinks_segments_and_tells_peers() -> None:
    import os

    with ShmHarness() as h:
        a, b, _, ma, _, mb = pair(h, MiB)
        finish(a.read(ma, mb, TransferPlan([0], [0], [4096])))
        assert len(_segments_of(os.getpid())) == 2
        b.close()
        assert len(_segments_of(os.getpid())) == 1
        with pytest.raises(Exception, match="closed its shared memory"):
            a.read(ma, mb, TransferPlan([0], [0], [4096]))
        a.close()
        assert _segments_of(os.getpid()) == []


@pytest.mark.timeout(60)
def test_shm_sweep_unlinks_segments_of_dead_owners() -> None:
    with ShmHarness() as h:
        peer = h.spawn_peer("prefill-0", MiB)
        live = _segments_of(peer.pid)
        assert len(live) == 1
        assert live[0] not in sweep_stale_segments()  # its owner is alive: kept
        peer.kill()  # SIGKILL: no atexit, the segment stays behind
        assert _segments_of(peer.pid) == live
        assert live[0] in sweep_stale_segments()
        assert _segments_of(peer.pid) == []


@pytest.mark.timeout(30)
def test_shm_allocation_that_cannot_fit_fails_cleanly() -> None:
    import os

    with ShmHarness() as h:
        a = h.make_agent("decode-0")
        before = _segments_of(os.getpid())
        with pytest.raises(BackendUnavailable, match="cannot reserve 70368744177664 bytes"):
            a.allocate((1 << 46,), torch.uint8, "cpu")  # 64 TiB: more than any /dev/shm holds
        assert _segments_of(os.getpid()) == before  # nothing left behind


# -- the benchmark of these backends -------------------------------------------------------------


@pytest.mark.timeout(60)
def test_transfer_bench_quick_runs_and_writes_its_results(tmp_path: Path) -> None:
    from bench.transfer_bench import main

    main(["--quick", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "transfer_bench_quick.json").read_text())
    assert [r["segment_bytes"] for r in result["rows"]] == [4096 << i for i in range(5)]
    for row in result["rows"]:
        for key in ("tcp_read", "raw_read", "shm_write", "numpy_write"):
            assert row[f"{key}_gbps"] > 0
    assert (tmp_path / "transfer_bench_quick.png").stat().st_size > 10_000
