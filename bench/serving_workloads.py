"""The serving benchmark's other workloads: shared-prefix (groups of requests sharing a prefix, the
prefix cache off and on side by side) and n-choices (one request of n choices against n requests)."""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
import time
from pathlib import Path
from typing import Any

import yaml

from bench.common import (
    serve_doc,
    set_path,
    stats,
)
from bench.http_client import Connection, Record, stream_completion
from bench.report_workloads import prefix_line
from bench.serving import SERIES, start_ray, system_args
from bench.serving_cells import python_cell


def shared_prefix_prompts(
    reuse: float, length: int, groups: int, group_size: int, seed: int
) -> list[list[int]]:
    """``groups`` x ``group_size`` prompts of ``length`` byte tokens, the first ``reuse`` of each shared
    within its group; round-robin over the groups."""
    rng = random.Random(f"{seed}-{reuse}")
    shared = int(length * reuse)
    heads = [[rng.randrange(32, 127) for _ in range(shared)] for _ in range(groups)]
    return [
        head + [rng.randrange(32, 127) for _ in range(length - shared)]
        for _ in range(group_size)
        for head in heads
    ]


def shared_prefix(a: argparse.Namespace, report: dict[str, Any], work: Path) -> None:
    """Per system, a cache-off and a cache-on pipeline side by side, their cells alternating
    (--repeats rounds, fresh prompts each), so that a change in the host's load meets both."""
    from moriio_ray import PDPipeline

    length, c = a.prompt_lens[0], a.concurrency[0]
    # room for every request in flight and a few groups' prefixes
    room = [f"engine.num_blocks={(-(-length // 16) + 4) * (c + 8)}", f"model.max_model_len={length + 256}"]
    start_ray(a)

    def cache_totals(pipe: Any) -> dict[str, int]:
        keys = ("num_hit_tokens", "num_queried_tokens")
        return {
            f"{k}_{w['role']}": w["prefix_cache"][k] for w in pipe.stats()["workers"].values() for k in keys
        }

    for system in [s for s in ("read", "write", "colocated") if s in a.systems]:
        sets = lambda on, system=system: [
            *room,
            f"name=prefix-{system}-{on}",
            f"engine.enable_prefix_caching={on}",
        ]
        pipes = {
            on: PDPipeline.launch(system_args(a, system, a.backends[0], *sets(on))) for on in (False, True)
        }
        try:
            runs: dict[tuple[bool, float], list[tuple[list[Record], float, dict[str, int]]]] = {}
            for pipe in pipes.values():  # a warm-up, unrecorded
                asyncio.run(
                    python_cell(pipe, a)(shared_prefix_prompts(0.0, length, 2, 1, a.seed - 1), ("c", c))
                )
            for round_ in range(a.repeats):
                for reuse in a.reuse:
                    batch = shared_prefix_prompts(reuse, length, a.groups, a.group_size, a.seed + round_)
                    for on, pipe in pipes.items():
                        before, t0 = cache_totals(pipe), time.perf_counter()
                        records, _ = asyncio.run(python_cell(pipe, a, keep_tokens=True)(batch, ("c", c)))
                        wall_s, after = time.perf_counter() - t0, cache_totals(pipe)
                        delta = {k: after[k] - before[k] for k in after}
                        runs.setdefault((on, reuse), []).append((records, wall_s, delta))
            for (on, reuse), cells in runs.items():
                report["cells"].append(prefix_cell(SERIES[system], on, reuse, cells))
                print(prefix_line(report["cells"][-1]), flush=True)
        finally:
            for pipe in pipes.values():
                pipe.shutdown()
    off = {(x["series"], x["reuse"]): x["tokens"] for x in report["cells"] if not x["cache"]}
    for cell in report["cells"]:  # greedy tokens: the cache must not change one
        cell["tokens_equal_cache_off"] = cell.pop("tokens") == off[(cell["series"], cell["reuse"])]


def prefix_cell(
    series: str, on: bool, reuse: float, runs: list[tuple[list[Record], float, dict[str, int]]]
) -> dict[str, Any]:
    records = [r for rs, _, _ in runs for r in sorted(rs, key=lambda r: r.index)]
    ok, wall_s = [r for r in records if r.ok], sum(w for _, w, _ in runs)
    extra = lambda key: [float((r.extra or {}).get(key) or 0) for r in ok]

    def rate(role: str) -> float:
        queried = sum(d[f"num_queried_tokens_{role}"] for _, _, d in runs)
        return sum(d[f"num_hit_tokens_{role}"] for _, _, d in runs) / queried if queried else 0.0

    out = {"series": series, "cache": on, "reuse": reuse, "num_requests": len(records), "wall_s": wall_s}
    out |= {"num_errors": len(records) - len(ok), "ttft_s": stats([r.ttft_s for r in ok])}
    out |= {
        "output_tok_s": sum(r.num_tokens for r in ok) / wall_s,
        "transfer_bytes": stats(extra("transfer_bytes")),
    }
    out |= {
        "cached_tokens_per_request": stats(extra("cached_tokens"))["mean"],
        "hit_rate_prefill": rate("prefill"),
    }
    return out | {
        "hit_rate_decode": rate("decode"),
        "tokens": [(r.extra or {}).get("token_ids") for r in records],
    }


def n_choices(a: argparse.Namespace, report: dict[str, Any], work: Path) -> None:
    """Per round, each with a fresh prompt: one request (n = 1), one of --n choices, and --n requests
    of one prompt at once; TTFT to the first SSE event with a token (the last of the --n requests');
    ``computed``: the prompt tokens P computed for the cell (looked up less found, from /stats)."""
    from bench.launch import ServeProcess

    length, rng = a.prompt_lens[0], random.Random(a.seed)
    doc = serve_doc(a.config)
    args = copy.deepcopy(doc["applications"][0]["args"])
    for assignment in [
        "name=n-choices",
        f"model.max_model_len={length + 64}",
        "engine.enable_prefix_caching=true",
        *a.set,
    ]:
        set_path(args, assignment)
    path = work / "n_choices.yaml"
    doc["applications"][0]["args"] = args
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    with ServeProcess(path) as server:

        def computed() -> int:
            _, body = server.get("/stats")
            cache = next(w["prefix_cache"] for w in body["workers"].values() if w["role"] == "prefill")
            return int(cache["num_queried_tokens"] - cache["num_hit_tokens"])

        async def ttft(prompt: list[int], n: int, seed: int) -> float:
            body = dict(prompt=prompt, max_tokens=4, temperature=1.0, seed=seed, n=n, stream=True, logprobs=0)
            body["ignore_eos"] = True
            conn = Connection("127.0.0.1", server.http_port)
            rec = await stream_completion(conn, "/v1/completions", 0, json.dumps(body).encode())
            conn.close()
            if not rec.ok:
                raise RuntimeError(f"HTTP {rec.status}: {rec.error}")
            return rec.ttft_s

        async def cell(kind: str, prompt: list[int], seed: int) -> dict[str, float]:
            before = computed()
            if kind == "separate":
                value = max(await asyncio.gather(*(ttft(prompt, 1, seed + i) for i in range(a.n))))
            else:
                value = await ttft(prompt, a.n if kind == "n" else 1, seed)
            return {"ttft_s": value, "computed": computed() - before}

        def fresh() -> list[int]:
            return [rng.randrange(32, 127) for _ in range(length)]

        asyncio.run(cell("single", fresh(), 0))  # warm-up
        for r in range(a.rounds):
            for kind in (
                "single",
                "n",
                "separate",
            ):  # a fresh prompt per cell: nothing of it is cached before
                report["cells"].append(
                    {"series": kind, "round": r, **asyncio.run(cell(kind, fresh(), 1000 * r))}
                )
                print(f"round {r + 1}/{a.rounds}: {report['cells'][-1]}", flush=True)
