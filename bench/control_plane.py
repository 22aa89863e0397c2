"""The control plane at scale, simulated: the real coordinator, routers and membership code against
N simulated engines (``bench/control_plane_sim.py``), for each N of ``--sizes``.

    python -m bench.control_plane --sizes 16,128,1000 --callers 100 --rate 1000

Per N it measures, with ``--callers`` callers routing ``--rate`` requests a second in all:
- the coordinator's CPU (seconds per second) and resident memory over a steady window;
- ping round trips, and the effective ping period (configured period plus one round);
- how late a death is detected: an engine that crashes (its pings fail) and one that hangs (its
  pings never answer);
- how long a change takes to reach every caller and every engine: the death, the replacement, a
  scale-up of ``--scale-up`` engines;
- the router's cost per request (pick P, pick D for it, account), in the callers and alone;
- descriptor bytes per engine and in total, and the membership's bytes (whole and one change);
- requests routed to an engine already dead (refused by it) around each death.
Output: JSON and a PNG of each measure against N (``bench/control_plane_report.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import pickle
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, csv, run_record, stats, write_json

EVENT_TIMEOUT_S = 20.0
LAYOUT = {"num_layers": 32, "num_blocks": 8192, "block_size": 16, "num_kv_heads": 8, "head_dim": 128}


def sim_config(n: int, args: argparse.Namespace) -> Any:
    from moriio_ray.config_load import parse_pipeline_config

    return parse_pipeline_config(
        {
            "name": f"cp-sim-{n}",
            "model": {"preset": "tiny"},
            "engine": {"device": "cpu"},
            "transfer": {"backend": "tcp"},
            "pool": {
                "prefill": {"replicas": n // 2, "num_cpus": 0},
                "decode": {"replicas": n - n // 2, "num_cpus": 0},
            },
            "runtime": {"health_check_period_s": args.period},
        }
    )


def router_alone(n: int, repeats: int = 20_000) -> dict[str, Any]:
    """The router's cost per request at ``n`` engines, in this process and nothing else running."""
    from moriio_ray.caller.router import Router
    from moriio_ray.protocol.messages import Member, Membership

    members = [
        Member(f"e{i}", "prefill" if i % 2 else "decode", 1, f"n{i // 8}", actor_name=f"e{i}", info_data=b"")
        for i in range(n)
    ]
    router = Router(seed=0)
    router.update(Membership(version=1, members=members))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        p = router.pick("prefill")
        d = router.pick_decode_for(p)
        router.acquire(p, 1)
        router.acquire(d, 1)
        router.release(p, 1)
        router.release(d, 1)
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    return stats(samples)


def answered(timeline: dict[str, Any], change: str, start: float | None) -> float | None:
    """How long after ``start`` the coordinator had answered every watcher waiting for the
    version that published ``change`` (its own part of a change's spread)."""
    version = timeline["versions"].get(change)
    done = timeline["answered"].get(version)
    return None if done is None or start is None else done[1] - start


def spread(times: dict[str, float], start: float) -> dict[str, Any]:
    """How long after ``start`` a change reached its recipients (seconds): all, and the callers
    and the engines apart."""
    delays = [max(0.0, t - start) for t in times.values()]
    out = stats(delays)
    out["max"] = max(delays) if delays else None
    out["recipients"] = len(delays)
    callers = [max(0.0, t - start) for who, t in times.items() if who.startswith("caller")]
    engines = [max(0.0, t - start) for who, t in times.items() if not who.startswith("caller")]
    out["callers_p99"], out["engines_p99"] = stats(callers)["p99"], stats(engines)["p99"]
    return out


class Run:
    """One N: the pool, its callers, and the measures."""

    def __init__(self, n: int, args: argparse.Namespace) -> None:
        self.n, self.args = n, args
        self.result: dict[str, Any] = {"n": n}
        self.hosts: list[Any] = []
        self.callers: list[Any] = []
        self.coord: Any = None

    async def __call__(self) -> dict[str, Any]:
        import ray

        from bench.control_plane_hosts import SimCallers, SimHost
        from bench.control_plane_sim import SimCoordinator
        from moriio_ray.protocol.pool_state import NAMESPACE

        a, cfg = self.args, sim_config(self.n, self.args)
        timeout_s = cfg.runtime.remote_timeout_s
        opts = {"num_cpus": 0, "max_concurrency": 100_000}
        self.hosts = [
            ray.remote(SimHost).options(**opts).remote(a.engines_per_node, a.tp, LAYOUT, timeout_s)
            for _ in range(a.hosts)
        ]
        self.coord = (
            ray.remote(SimCoordinator)
            .options(name=f"coordinator:{cfg.name}", namespace=NAMESPACE, num_cpus=0, max_concurrency=100_000)
            .remote(cfg, self.hosts)
        )
        t0 = time.time()
        await self.coord.start.remote()
        self.result["start_s"] = time.time() - t0
        log(f"N={self.n}: pool of {self.n} simulated engines up in {self.result['start_s']:.1f} s")
        per = max(1, a.callers // a.caller_hosts)
        callers = ray.remote(SimCallers).options(**opts)
        self.callers = [
            callers.remote(f"caller{i}", per, self.coord, self.hosts, timeout_s)
            for i in range(a.caller_hosts)
        ]
        await asyncio.gather(*(c.start.remote(a.rate / a.caller_hosts, a.service_s) for c in self.callers))
        try:
            await asyncio.sleep(a.warmup_s)
            await self.steady()
            await self.descriptors()
            for how in ("crashed", "hung"):
                await self.death(how)
            await self.scale_up()
        finally:
            await self.coord.shutdown.remote()
            for actor in [self.coord, *self.callers, *self.hosts]:
                ray.kill(actor)
        return self.result

    async def steady(self) -> None:
        await asyncio.gather(*(c.report.remote() for c in self.callers))  # drop the warm-up's samples
        before = await self.coord.measure.remote()
        routed0 = sum(
            [r["routed"] for r in await asyncio.gather(*(c.report.remote(False) for c in self.callers))]
        )
        await asyncio.sleep(self.args.window_s)
        after = await self.coord.measure.remote()
        reports = await asyncio.gather(*(c.report.remote() for c in self.callers))
        dt = after["unix"] - before["unix"]
        route_us = [ns / 1e3 for r in reports for ns in r["route_ns"]]
        self.result.update(
            coordinator_cpu=(after["cpu_s"] - before["cpu_s"]) / dt,
            coordinator_rss_bytes=after["rss_bytes"],
            coordinator_imports_torch=after["torch"],
            ping_ms=stats([s * 1e3 for s in after["ping_s"]]),
            ping_period_s=stats(after["ping_gap_s"]),
            router_us=stats(route_us),
            router_alone_us=router_alone(self.n),
            routed_per_s=(sum(r["routed"] for r in reports) - routed0) / dt,
        )
        log(
            f"N={self.n}: coordinator {self.result['coordinator_cpu']:.3f} core, "
            f"{after['rss_bytes'] / 2**20:.0f} MiB; ping p50 {self.result['ping_ms']['p50']:.2f} ms; "
            f"router {self.result['router_alone_us']['p50']:.1f} us alone; "
            f"{self.result['routed_per_s']:.0f} requests/s routed"
        )

    async def descriptors(self) -> None:
        import ray

        whole = await self.coord.get_membership.remote(-1, 0.0)
        change = await self.coord.get_membership.remote(whole.version - 1, 0.0)
        info = whole.members[0].info
        per = len(pickle.dumps(info))
        self.result.update(
            descriptor_bytes=per,
            descriptor_total_bytes=per * self.n,
            membership_bytes=len(ray.cloudpickle.dumps(whole)),
            membership_change_bytes=len(ray.cloudpickle.dumps(change)),
        )

    async def _track(self, subjects: list[tuple[str, int, str]]) -> None:
        await asyncio.gather(*(x.track.remote(subjects) for x in [*self.hosts, *self.callers]))

    async def _reached(self, subject: tuple[str, int, str], expect: int) -> dict[str, float]:
        """Who has seen ``subject`` (waits until ``expect`` have, or EVENT_TIMEOUT_S)."""
        name = "|".join(map(str, subject))
        t_end = time.time() + EVENT_TIMEOUT_S
        while True:
            reports = await asyncio.gather(*(x.report.remote(False) for x in [*self.hosts, *self.callers]))
            seen = {k: t for r in reports for k, t in r["reached"].get(name, {}).items()}
            if len(seen) >= expect or time.time() > t_end:
                return seen
            await asyncio.sleep(0.2)

    async def death(self, how: str) -> None:
        index = {"crashed": 0, "hung": 1}[how]
        key = f"cp-sim-{self.n}-decode-{index}"
        epoch = await self.coord.epoch_of.remote(key)
        down, up = (key, epoch, "down"), (key, epoch + 1, "up")
        await self._track([down, up])
        host = self.hosts[(self.n // 2 + index) % len(self.hosts)]  # decode slots follow the prefill ones
        refused0 = await self._total("refused")
        t_crash = await host.crash.remote(key, how)
        recipients = self.n - 1 + self.args.callers
        seen_down = await self._reached(down, recipients)
        seen_up = await self._reached(up, recipients)
        tl = await self.coord.timeline.remote()
        detected = tl["detected"].get(f"{key}|{epoch}")
        upped = tl["upped"].get(f"{key}|{epoch + 1}")
        self.result[f"death_{how}"] = {
            "detect_s": None if detected is None else detected - t_crash,
            "down": spread(seen_down, detected) if detected else None,
            "replacement": spread(seen_up, upped) if upped else None,
            "coordinator_answered_down_s": answered(tl, f"down|{key}|{epoch}", detected),
            "coordinator_answered_up_s": answered(tl, f"up|{key}|{epoch + 1}", upped),
            "refused_requests": await self._total("refused") - refused0,
        }
        d = self.result[f"death_{how}"]
        gone = d["down"] or {}
        log(
            f"N={self.n}: {how} engine detected after {d['detect_s']} s; its death reached "
            f"{gone.get('recipients')} of {recipients}, p99 {gone.get('p99')} s"
        )

    async def _total(self, what: str) -> int:
        """The callers' count of ``what`` (routed, refused), all processes together."""
        reports = await asyncio.gather(*(c.report.remote(False) for c in self.callers))
        return sum(r[what] for r in reports)

    async def scale_up(self) -> None:
        count = self.args.scale_up
        first = self.n - self.n // 2
        keys = [f"cp-sim-{self.n}-decode-{first + i}" for i in range(count)]
        subjects = [(k, 1, "up") for k in keys]
        await self._track(subjects)
        await self.coord.scale_up.remote("decode", count)
        tl = await self.coord.timeline.remote()
        recipients = self.n + count - 1 + self.args.callers
        spreads = []
        for s in subjects:
            seen = await self._reached(s, recipients)
            spreads.append(spread(seen, tl["upped"][f"{s[0]}|1"]))
        worst = max(spreads, key=lambda x: x["max"] or 0.0)
        worst["coordinator_answered_s"] = max(
            (answered(tl, f"up|{k}|1", tl["upped"][f"{k}|1"]) or 0.0) for k in keys
        )
        self.result["scale_up"] = worst
        reach = f"{worst['recipients']} of {recipients}"
        log(f"N={self.n}: scale-up of {count} reached {reach}, p99 {worst['p99']} s")


def log(text: str) -> None:
    print(f"[control_plane {time.strftime('%H:%M:%S')}] {text}", flush=True)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=csv(int), default=[16, 128, 1000], help="engine counts N")
    ap.add_argument("--callers", type=int, default=100)
    ap.add_argument("--caller-hosts", type=int, default=4, help="processes the callers share")
    ap.add_argument("--hosts", type=int, default=4, help="processes the simulated engines share")
    ap.add_argument("--engines-per-node", type=int, default=8, help="engines per simulated node id")
    ap.add_argument("--tp", type=int, default=1, help="ranks per engine (their descriptors)")
    ap.add_argument("--rate", type=float, default=1000.0, help="requests a second, all callers")
    ap.add_argument("--service-s", type=float, default=1.0, help="how long a request holds its P and D")
    ap.add_argument("--period", type=float, default=0.5, help="runtime.health_check_period_s")
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument("--window-s", type=float, default=10.0, help="the steady window")
    ap.add_argument("--scale-up", type=int, default=8, help="engines added in the scale-up event")
    ap.add_argument("--out", type=Path, default=RESULTS / "control_plane.json")
    ap.add_argument("--no-plot", action="store_true")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import ray

    # a cluster of its own (without an address, ray.init joins one that `ray start` left running)
    ray.init(
        address="local", namespace="moriio_ray", include_dashboard=False, log_to_driver=False, num_cpus=4
    )
    doc = run_record("control_plane", vars(args))
    doc["results"] = []
    try:
        for n in args.sizes:
            doc["results"].append(asyncio.run(Run(n, args)()))
            write_json(args.out, doc)  # after each N: a later failure keeps what ran
    finally:
        ray.shutdown()
    from bench.control_plane_report import fits, plot

    doc["fits"] = fits(doc["results"])
    write_json(args.out, doc)
    if not args.no_plot:
        plot(doc, args.out.with_suffix(".png"))
    log(f"wrote {args.out}")
    return doc


if __name__ == "__main__":
    main()
