"""The local Ray of the integration tests: one cluster for the session, nothing left in it by a module.

Starting and stopping a local cluster costs about 4 s on 2 cores, so the modules share one (started
by the first module that asks, shut down at the session's end; test_multinode ends it for a cluster
of its own, and the next module starts a new one). What must not cross from one module to the next
is what a module started in it: at each module's end every named actor and placement group the
module created must be gone (its pipelines shut down), or the module's last test errors and the
leftovers are killed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import ray
from ray.util import placement_group_table, remove_placement_group
from ray.util.placement_group import PlacementGroup

LEFTOVER_WAIT_S = 30.0  # a pipeline's shutdown ends its actors and group asynchronously


def start_local_ray() -> None:
    """A local Ray with 4 logical CPUs (the 2P2D pools take half a CPU per worker)."""
    ray.init(
        # a cluster of its own: without an address, ray.init joins the latest cluster that a
        # `ray start` on this host recorded (another test run's), and then refuses num_cpus
        address="local",
        num_cpus=4,
        include_dashboard=False,
        namespace="moriio_ray",
        logging_level="WARNING",
        log_to_driver=False,
        # the metrics agent exports every 2 s, not every 10 s (test_http_failures scrapes it)
        _system_config={"metrics_report_interval_ms": 2000},
    )


def _named_actors() -> set[tuple[str, str]]:
    return {(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)}


def _live_groups() -> set[str]:
    return {gid for gid, g in placement_group_table().items() if g["state"] != "REMOVED"}


@pytest.fixture(scope="session")
def _ray_session() -> Iterator[None]:
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_cpu(_ray_session: None) -> Iterator[None]:
    """The session's local Ray (started if none runs); the module must leave nothing in it."""
    if not ray.is_initialized():
        start_local_ray()
    actors_before, groups_before = _named_actors(), _live_groups()
    yield
    if not ray.is_initialized():  # the module ended the cluster itself
        return
    deadline_s = time.monotonic() + LEFTOVER_WAIT_S
    while True:
        actors, groups = _named_actors() - actors_before, _live_groups() - groups_before
        if not (actors or groups) or time.monotonic() > deadline_s:
            break
        time.sleep(0.1)
    for namespace, name in actors:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except ValueError:
            pass
    for gid in groups:
        remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(gid))))
    assert not (actors or groups), (
        f"the module left named actors {sorted(actors)} and groups {sorted(groups)}"
    )
