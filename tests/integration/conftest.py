from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray


@pytest.fixture(scope="module")
def ray_cpu() -> Iterator[None]:
    """A local Ray with 4 logical CPUs (the 2P2D pools take half a CPU per worker)."""
    if not ray.is_initialized():
        ray.init(
            # a cluster of its own: without an address, ray.init joins the latest cluster that a
            # `ray start` on this host recorded (another test run's), and then refuses num_cpus
            address="local",
            num_cpus=4,
            include_dashboard=False,
            namespace="moriio_ray",
            logging_level="WARNING",
            log_to_driver=False,
        )
    yield
