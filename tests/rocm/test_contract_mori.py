"""The transfer-agent contract on the real ``mori`` backend (AMD GPUs, ``amd-mori``).

Collected everywhere; skipped with the reason below unless ``mori.io`` imports and a ROCm GPU is
present. Two agents in one process, as MoRI's own tests run two IOEngines: the prefill side on
GPU 0 and the decode side on GPU 1 (GPU 0 again when there is one, rdma only).
"""

from __future__ import annotations

import importlib
import threading

import numpy as np
import pytest
import torch

from moriio_ray.config import MoriConfig, TransferConfig
from moriio_ray.errors import (
    BackendUnavailable,
    PeerLost,
    SegmentOutOfBounds,
    StaleDescriptor,
    TransferTimeout,
)
from moriio_ray.transfer import create_agent

REASON = "needs mori (amd-mori) and a ROCm GPU"


def _has_mori_and_rocm_gpu() -> bool:
    try:
        importlib.import_module("mori.io")
    except ImportError:
        return False
    return torch.version.hip is not None and torch.cuda.is_available()


pytestmark = [pytest.mark.rocm, pytest.mark.skipif(not _has_mori_and_rocm_gpu(), reason=REASON)]

REGION_BYTES = 8 << 20


@pytest.fixture(params=["rdma", "xgmi"])
def pair(request):
    kind = request.param
    if kind == "xgmi" and torch.cuda.device_count() < 2:
        pytest.skip("xgmi needs two ROCm GPUs")
    config = TransferConfig(backend="mori", mori=MoriConfig(backend=kind))
    try:
        p = create_agent(config, "prefill-0")
        d = create_agent(config, "decode-0")
    except BackendUnavailable as exc:
        pytest.skip(f"MoRI {kind} cannot start here: {exc}")
    dev_p, dev_d = "cuda:0", f"cuda:{min(1, torch.cuda.device_count() - 1)}"
    src = p.allocate((REGION_BYTES,), torch.uint8, dev_p)
    src.copy_(torch.randint(0, 256, (REGION_BYTES,), dtype=torch.uint8))
    dst = d.allocate((REGION_BYTES,), torch.uint8, dev_d)
    p_mem, d_mem = p.register(src), d.register(dst)
    d.connect(p.engine_desc())
    p.connect(d.engine_desc())
    yield p, d, src, dst, p_mem, d_mem
    d.close()
    p.close()


@pytest.mark.timeout(60)
def test_read_and_write_round_trip(pair):
    p, d, src, dst, p_mem, d_mem = pair
    d.read(d_mem, p_mem, [0], [4096], [65536]).wait(10.0)
    assert torch.equal(dst[:65536].cpu(), src[4096 : 4096 + 65536].cpu())
    p.write(p_mem, d_mem, [0, 1 << 20], [1 << 21, 3 << 20], [4096, 8192]).wait(10.0)
    torch.cuda.synchronize()
    assert torch.equal(dst[1 << 21 : (1 << 21) + 4096].cpu(), src[:4096].cpu())
    assert torch.equal(dst[3 << 20 : (3 << 20) + 8192].cpu(), src[1 << 20 : (1 << 20) + 8192].cpu())


@pytest.mark.timeout(60)
def test_random_scatter_gather_1000_segments(pair):
    _, d, src, dst, p_mem, d_mem = pair
    rng = np.random.default_rng(0)
    slots = rng.permutation(REGION_BYTES // 4096)[:1000]
    remote = rng.permutation(REGION_BYTES // 4096)[:1000].astype(np.int64) * 4096
    local = slots.astype(np.int64) * 4096
    sizes = rng.integers(1, 4097, 1000).astype(np.int64)
    d.read(d_mem, p_mem, local, remote, sizes).wait(30.0)
    expect = np.zeros(REGION_BYTES, dtype=np.uint8)
    host_src = src.cpu().numpy()
    for lo, ro, n in zip(local, remote, sizes, strict=True):
        expect[lo : lo + n] = host_src[ro : ro + n]
    assert np.array_equal(dst.cpu().numpy(), expect)


@pytest.mark.timeout(60)
def test_out_of_bounds_refused_on_both_sides(pair):
    _, d, _, _, p_mem, d_mem = pair
    with pytest.raises(SegmentOutOfBounds, match="local offset"):
        d.read(d_mem, p_mem, [REGION_BYTES - 8], [0], [16])
    with pytest.raises(SegmentOutOfBounds, match="remote offset"):
        d.read(d_mem, p_mem, [0], [REGION_BYTES], [1])


@pytest.mark.timeout(60)
def test_timeout_then_peer_lost_on_disconnect(pair):
    p, d, _, _, p_mem, d_mem = pair
    d.inject_delay(2.0)
    with pytest.raises(TransferTimeout):
        d.read(d_mem, p_mem, [0], [0], [4096]).wait(0.05)
    x = d.read(d_mem, p_mem, [0], [0], [4096])
    d.disconnect(p.key)
    with pytest.raises(PeerLost):
        x.wait(10.0)


@pytest.mark.timeout(60)
def test_eight_concurrent_transfers(pair):
    _, d, src, dst, p_mem, d_mem = pair
    chunk = REGION_BYTES // 8
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            d.read(d_mem, p_mem, [i * chunk], [(7 - i) * chunk], [chunk]).wait(30.0)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60.0)
    assert not errors
    for i in range(8):
        want = src[(7 - i) * chunk : (8 - i) * chunk].cpu()
        assert torch.equal(dst[i * chunk : (i + 1) * chunk].cpu(), want)


@pytest.mark.timeout(60)
def test_older_epoch_refused(pair):
    p, d, *_ = pair
    restarted = create_agent(p.config, p.key, epoch=p.epoch + 1)
    try:
        d.connect(restarted.engine_desc())
        with pytest.raises(StaleDescriptor):
            d.connect(p.engine_desc())
    finally:
        restarted.close()
