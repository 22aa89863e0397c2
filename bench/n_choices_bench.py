"""``n`` choices in one request against ``n`` separate requests of the same prompt, through HTTP.

``python bench/serving_bench.py --workload n-choices`` runs it. A ``serve run`` of
``configs/tiny_1p1d_cpu.yaml`` (1P1D READ on the CPU, the prefix cache on) answers, per round and
each with a fresh prompt of ``--prompt-len`` tokens:
- ``single``: one request, ``n = 1`` (the TTFT baseline);
- ``n``: one request with ``n`` choices (its first choice prefills; the others find the prompt's
  full blocks in the prefix cache);
- ``separate``: ``n`` requests of one prompt sent at once (each may compute the prompt: the cache
  finds a block only once a step has computed it).

TTFT is the time to the first SSE event that carries a token (a streamed reply sends its first
frames only once every choice has its first token). ``computed`` is the prompt tokens P computed
for the cell (looked up minus found cached, from P's stats): one prefill of the prompt is
``prompt_len``. Writes bench/results/n_choices_<tag>.json and .png.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from moriio_ray.serve.process import ServeProcess

CONFIG = Path("configs/tiny_1p1d_cpu.yaml")
CELLS = ("single", "n", "separate")


def _config(path: Path, prompt_len: int, cache: bool) -> Path:
    doc = yaml.safe_load(CONFIG.read_text())
    args = doc["applications"][0]["args"]
    args["name"] = "n-choices"
    args["model"]["max_model_len"] = prompt_len + 64
    args["engine"]["enable_prefix_caching"] = cache
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _p_tokens(http: httpx.Client) -> tuple[int, int]:
    """P's prompt tokens looked up and found cached, so far."""
    for w in http.get("/stats").json()["workers"].values():
        if w["role"] == "prefill":
            cache = w["prefix_cache"]
            return cache["num_queried_tokens"], cache["num_hit_tokens"]
    raise RuntimeError("no prefill worker in /stats")


def _ttft(http: httpx.Client, prompt: list[int], n: int, seed: int) -> float:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 1.0, "seed": seed}
    body |= {"n": n, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    with http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read()[:300]!r}")
        ttft = None
        for line in resp.iter_lines():
            if ttft is None and line.startswith("data: {") and '"text"' in line:
                ttft = time.perf_counter() - t0
        if ttft is None:
            raise RuntimeError("the stream carried no token")
        return ttft


def _cell(http: httpx.Client, cell: str, prompt: list[int], n: int, seed: int) -> dict[str, float]:
    import concurrent.futures

    looked, hit = _p_tokens(http)
    if cell == "single":
        ttft = _ttft(http, prompt, 1, seed)
    elif cell == "n":
        ttft = _ttft(http, prompt, n, seed)
    else:  # n requests at once; TTFT: when the last of them has its first token, as for `n`
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            ttft = max(pool.map(lambda i: _ttft(http, prompt, 1, seed + i), range(n)))
    looked2, hit2 = _p_tokens(http)
    return {"ttft_s": ttft, "computed": (looked2 - looked) - (hit2 - hit)}


def run(a: argparse.Namespace, tag: str, commit: str) -> dict[str, Any]:
    rng = random.Random(a.seed)
    report: dict[str, Any] = {"benchmark": "n_choices", "tag": tag, "measured_at_commit": commit}
    report |= {"prompt_len": a.prompt_len, "n": a.n, "rounds": a.rounds, "config": str(CONFIG)}
    results: dict[str, list[dict[str, float]]] = {c: [] for c in CELLS}
    config = _config(Path(tempfile.mkdtemp(prefix="nchoices")) / "serve.yaml", a.prompt_len, True)
    with ServeProcess(config) as server:
        server.wait_healthy(300)
        with httpx.Client(base_url=server.base_url, timeout=300) as http:
            _cell(http, "single", [rng.randrange(32, 127) for _ in range(a.prompt_len)], a.n, 0)  # warm-up
            for r in range(a.rounds):
                for cell in CELLS:  # a fresh prompt per cell: nothing of it is cached before
                    prompt = [rng.randrange(32, 127) for _ in range(a.prompt_len)]
                    results[cell].append(_cell(http, cell, prompt, a.n, 1000 * r))
                    got = results[cell][-1]
                    print(f"round {r + 1}/{a.rounds} {cell:8s} ttft {1e3 * got['ttft_s']:7.1f} ms, "
                          f"P computed {got['computed']} prompt tokens", flush=True)  # fmt: skip
    summary = {}
    for cell, rows in results.items():
        summary[cell] = {
            "ttft_p50_ms": 1e3 * statistics.median(r["ttft_s"] for r in rows),
            "computed_p50": statistics.median(r["computed"] for r in rows),
        }
    single = summary["single"]["ttft_p50_ms"]
    for cell in CELLS:
        summary[cell]["ttft_vs_single"] = summary[cell]["ttft_p50_ms"] / single
        summary[cell]["prefills"] = summary[cell]["computed_p50"] / a.prompt_len
    report["cells"] = results
    report["summary"] = summary
    return report


def write(report: dict[str, Any], out: str) -> Path:
    path = Path(out) / f"n_choices_{report['tag']}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["summary"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = list(summary)
    left.bar(names, [summary[c]["ttft_p50_ms"] for c in names])
    left.set_ylabel("TTFT p50 (ms)")
    right.bar(names, [summary[c]["prefills"] for c in names])
    right.set_ylabel("prompt tokens P computed / prompt length")
    fig.suptitle(
        f"n={report['n']}, {report['prompt_len']}-token prompt, tiny 1P1D READ, HTTP "
        f"({report['measured_at_commit']})"
    )
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return path
