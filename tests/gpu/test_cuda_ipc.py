"""cuda_ipc between two agents of one process: on one GPU, and across two GPUs (peer pointers)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from cuda_ipc_peer import apply, pattern, random_segments

from moriio_ray.config import CUDA_IPC_METHODS, CudaIpcConfig
from moriio_ray.errors import SegmentOutOfBounds, TransferTimeout
from moriio_ray.transfer import TransferConfig, create_agent
from moriio_ray.transfer.cuda_kernels import KernelVariant
from moriio_ray.transfer.plan import TransferPlan

torch = pytest.importorskip("torch")

REGION_BYTES = 8 << 20
PAIRS = [
    pytest.param((0, 0), id="one-gpu", marks=pytest.mark.gpu),
    pytest.param((0, 1), id="two-gpus", marks=pytest.mark.gpu(min_gpus=2)),
]


class Side:
    def __init__(self, key: str, device: int, seed: int, config: TransferConfig) -> None:
        self.agent: Any = create_agent(config, key)  # a CudaIpcAgent: read/write take after=
        self.device = torch.device("cuda", device)
        self.host = pattern(REGION_BYTES, seed)
        self.region = self.agent.allocate((REGION_BYTES,), torch.uint8, self.device)
        self.region.copy_(torch.from_numpy(self.host))
        self.mem = self.agent.register(self.region)

    def bytes(self) -> np.ndarray:
        torch.cuda.synchronize(self.device)
        return self.region.cpu().numpy()


def make_pair(devices: tuple[int, int], config: TransferConfig | None = None) -> tuple[Side, Side]:
    config = config or TransferConfig(backend="cuda_ipc")
    a, b = Side("a", devices[0], 1, config), Side("b", devices[1], 2, config)
    a.agent.connect(b.agent.engine_desc())
    b.agent.connect(a.agent.engine_desc())
    return a, b


@pytest.fixture(params=PAIRS)
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Side, Side]]:
    a, b = make_pair(request.param)
    yield a, b
    a.agent.close()
    b.agent.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["read", "write"])
def test_round_trip_of_aligned_blocks(pair: tuple[Side, Side], op: str) -> None:
    a, b = pair
    seg = 32 << 10
    local = np.array([0, 5, 9, 100], dtype=np.int64) * seg
    remote = np.array([7, 1, 200, 3], dtype=np.int64) * seg
    sizes = np.full(4, seg, dtype=np.int64)
    if op == "read":  # a pulls b's segments
        expect = a.host.copy()
        apply(expect, b.host, local, remote, sizes)
        a.agent.read(a.mem, b.mem, TransferPlan(local, remote, sizes)).wait(timeout_s=30)
        assert np.array_equal(a.bytes(), expect)
    else:  # a pushes into b
        expect = b.host.copy()
        apply(expect, a.host, remote, local, sizes)
        a.agent.write(a.mem, b.mem, TransferPlan(local, remote, sizes)).wait(timeout_s=30)
        assert np.array_equal(b.bytes(), expect)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["read", "write"])
def test_thousand_random_unaligned_segments_byte_for_byte(pair: tuple[Side, Side], op: str) -> None:
    a, b = pair
    rng = np.random.default_rng(7 if op == "read" else 8)
    dst, src, sizes = random_segments(rng, 1000, REGION_BYTES, REGION_BYTES, 5000)
    if op == "read":
        expect = a.host.copy()
        apply(expect, b.host, dst, src, sizes)
        x = a.agent.read(a.mem, b.mem, TransferPlan(dst, src, sizes))
    else:
        expect = b.host.copy()
        apply(expect, a.host, dst, src, sizes)
        x = a.agent.write(a.mem, b.mem, TransferPlan(src, dst, sizes))
    x.wait(timeout_s=30)
    assert x.done() and x.error() is None and x.bytes_moved == int(sizes.sum())
    got = a.bytes() if op == "read" else b.bytes()
    bad = np.flatnonzero(got != expect)
    assert bad.size == 0, f"{bad.size} bytes differ, first at {bad[:5]}"


# launch shapes the benchmark sweeps: each must copy the same bytes, launch after launch
VARIANTS = [
    KernelVariant(),
    KernelVariant(dynamic=False),
    KernelVariant(dynamic=False, chunk_bytes=0),
    KernelVariant(unroll=8, threads=256),
    KernelVariant(threads=1024, chunk_bytes=256 << 10),
    KernelVariant(chunk_bytes=4096, ctas_per_sm=1),
    KernelVariant(streaming=True, meta_in_host=True),
]


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", CUDA_IPC_METHODS)
def test_every_method_reads_and_writes_random_unaligned_segments(method: str) -> None:
    config = TransferConfig(backend="cuda_ipc", cuda_ipc=CudaIpcConfig(method=method))
    a, b = make_pair((0, 0), config)
    try:
        rng = np.random.default_rng(11)
        dst, src, sizes = random_segments(rng, 1000, REGION_BYTES, REGION_BYTES, 5000)
        expect = a.host.copy()
        apply(expect, b.host, dst, src, sizes)
        x = a.agent.read(a.mem, b.mem, TransferPlan(dst, src, sizes))
        x.wait(timeout_s=30)
        assert x.method == (method if method != "auto" else "kernel")
        assert np.array_equal(a.bytes(), expect)
        dst2, src2, sizes2 = random_segments(
            np.random.default_rng(12), 1000, REGION_BYTES, REGION_BYTES, 5000
        )
        expect_b = b.host.copy()
        apply(expect_b, expect, dst2, src2, sizes2)
        a.agent.write(a.mem, b.mem, TransferPlan(src2, dst2, sizes2)).wait(timeout_s=30)
        bad = np.flatnonzero(b.bytes() != expect_b)
        assert bad.size == 0, f"{method}: {bad.size} bytes differ, first at {bad[:5]}"
    finally:
        a.agent.close()
        b.agent.close()


@pytest.mark.gpu
@pytest.mark.timeout(180)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.label())
def test_every_kernel_shape_copies_pages_and_mixed_segments_launch_after_launch(
    variant: KernelVariant,
) -> None:
    config = TransferConfig(backend="cuda_ipc", cuda_ipc=CudaIpcConfig(method="kernel"))
    a, b = make_pair((0, 0), config)
    a.agent.tune(variant=variant)
    page = 16 << 10
    rng = np.random.default_rng(21)
    pages = (  # uniform sizes (the kernel divides), then coalesced runs and odd sizes (it searches)
        rng.choice(REGION_BYTES // page, 256, replace=False) * page,
        rng.choice(REGION_BYTES // page, 256, replace=False) * page,
        np.full(256, page),
    )
    mixed = random_segments(rng, 1500, REGION_BYTES, REGION_BYTES, 3000)
    one = (np.array([0]), np.array([0]), np.array([REGION_BYTES]))  # one segment: many items per CTA
    try:
        for dst, src, sizes in (pages, mixed, pages, one, mixed):
            a.region.copy_(torch.from_numpy(a.host))  # a no-op copy would leave this and fail
            expect = a.host.copy()
            apply(expect, b.host, dst, src, sizes)
            a.agent.read(a.mem, b.mem, TransferPlan(dst, src, sizes)).wait(timeout_s=30)
            bad = np.flatnonzero(a.bytes() != expect)
            assert bad.size == 0, f"{variant.label()}: {bad.size} bytes differ, first at {bad[:5]}"
    finally:
        a.agent.close()
        b.agent.close()


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_copy_engine_submission_names_its_mode() -> None:
    a, b = make_pair((0, 0), TransferConfig(backend="cuda_ipc", cuda_ipc=CudaIpcConfig(method="copy_engine")))
    try:
        a.agent.read(a.mem, b.mem, TransferPlan([0], [0], [4096])).wait(timeout_s=30)
        mode, reason = a.agent.copy_engine_mode(0)
        assert mode in ("batch_v2", "batch_v1", "per_segment")
        assert mode != "per_segment" or reason, "a fallback to one memcpy per segment must say why"
    finally:
        a.agent.close()
        b.agent.close()


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_small_transfer_path_copies_the_same_bytes() -> None:
    config = TransferConfig(backend="cuda_ipc", cuda_ipc=CudaIpcConfig(small_transfer_bytes=1 << 30))
    a, b = make_pair((0, 0), config)
    rng = np.random.default_rng(3)
    dst, src, sizes = random_segments(rng, 200, REGION_BYTES, REGION_BYTES, 3000)
    expect = a.host.copy()
    apply(expect, b.host, dst, src, sizes)
    a.agent.read(a.mem, b.mem, TransferPlan(dst, src, sizes)).wait(timeout_s=30)
    assert np.array_equal(a.bytes(), expect)
    a.agent.close()
    b.agent.close()


@pytest.mark.timeout(60)
def test_out_of_bounds_is_refused_before_launch(pair: tuple[Side, Side]) -> None:
    a, b = pair
    with pytest.raises(SegmentOutOfBounds, match="segment 1"):
        a.agent.read(a.mem, b.mem, TransferPlan([0, 0], [0, REGION_BYTES - 10], [16, 16]))
    with pytest.raises(SegmentOutOfBounds, match="local"):
        a.agent.write(a.mem, b.mem, TransferPlan([REGION_BYTES], [0], [1]))
    # a descriptor that claims more than the peer really registered is caught on the real memory
    import msgspec

    lying = msgspec.structs.replace(b.mem, num_bytes=REGION_BYTES * 1024)
    with pytest.raises(SegmentOutOfBounds, match=r"segment 1: remote offset .* as registered"):
        a.agent.read(a.mem, lying, TransferPlan([0, 64], [0, REGION_BYTES * 512], [16, 16]))
    a.agent.read(a.mem, lying, TransferPlan([0], [REGION_BYTES - 16], [16])).wait(
        timeout_s=30
    )  # inside: allowed
    a.region[:16].copy_(torch.from_numpy(a.host[:16]))
    assert np.array_equal(a.bytes(), a.host), "a refused transfer changed memory"


@pytest.mark.timeout(60)
def test_wait_times_out_then_completes_after_the_event_it_was_ordered_after(pair: tuple[Side, Side]) -> None:
    a, b = pair
    side = torch.cuda.Stream(device=a.device)
    fresh = pattern(64 << 10, 99)
    fresh_dev = torch.from_numpy(fresh).to(a.device)
    torch.cuda.synchronize(a.device)
    with torch.cuda.device(a.device), torch.cuda.stream(side):
        torch.cuda._sleep(1_500_000_000)  # about a second of GPU time before the source is rewritten
        a.region[: fresh.size].copy_(fresh_dev)
        ready = torch.cuda.Event()
        ready.record(side)
    x = a.agent.write(a.mem, b.mem, TransferPlan([0], [4096], [fresh.size]), after=ready)
    assert not x.done()
    with pytest.raises(TransferTimeout):
        x.wait(timeout_s=0.05)
    x.wait(timeout_s=30)
    assert np.array_equal(b.bytes()[4096 : 4096 + fresh.size], fresh), "the copy did not wait for `after`"


@pytest.mark.timeout(120)
def test_concurrent_transfers_from_many_threads(pair: tuple[Side, Side]) -> None:
    a, b = pair
    threads, per_thread = 8, 10
    slot = REGION_BYTES // threads
    errors: list[BaseException] = []
    plans = []
    for i in range(threads):
        rng = np.random.default_rng(100 + i)
        dst, src, sizes = random_segments(rng, 100, slot, REGION_BYTES, 2000)
        plans.append((dst + i * slot, src, sizes))

    def run(i: int) -> None:
        try:
            dst, src, sizes = plans[i]
            for _ in range(per_thread):
                a.agent.read(a.mem, b.mem, TransferPlan(dst, src, sizes)).wait(timeout_s=30)
        except BaseException as exc:  # collected and re-raised in the test thread
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not errors, errors
    expect = a.host.copy()
    for dst, src, sizes in plans:
        apply(expect, b.host, dst, src, sizes)
    assert np.array_equal(a.bytes(), expect)


@pytest.mark.timeout(60)
def test_empty_transfer_completes(pair: tuple[Side, Side]) -> None:
    a, b = pair
    x = a.agent.read(a.mem, b.mem, TransferPlan([], [], []))
    x.wait(timeout_s=5)
    assert x.done() and x.num_bytes == 0
