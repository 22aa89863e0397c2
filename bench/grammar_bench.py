"""Structured output: the per-token cost of a grammar library's token mask, llguidance against
xgrammar, in one run on the same tokenizer, schema and token sequences.

For each of --docs JSON documents valid under the schema, the document is tokenized, and for each
of its tokens the backend fills that position's bitmask (what an engine step asks for a
constrained row) and then accepts the token. Timed: the mask fill alone and the accept alone, per
token; compile time per schema; median and p90 over all tokens after one warm-up document.

    python bench/grammar_bench.py --model smollm2-135m-instruct
    python bench/grammar_bench.py --preset tiny
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for bench and moriio_ray

from bench.common import RESULTS, percentile, run_record, write_json
from moriio_ray.config import ModelConfig
from moriio_ray.engine.grammar import BACKENDS, available, bitmask, make_backend
from moriio_ray.engine.tokenizer import load_tokenizer

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        "city": {"enum": ["Paris", "Berlin", "Madrid", "Rome"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "city", "active"],
    "additionalProperties": False,
}
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "blue", "green", "river", "stone", "cloud"]


def documents(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        doc = {
            "name": " ".join(rng.sample(WORDS, 2)).title(),
            "age": rng.randint(0, 150),
            "tags": rng.sample(WORDS, rng.randint(0, 5)),
            "city": rng.choice(SCHEMA["properties"]["city"]["enum"]),
            "active": rng.random() < 0.5,
        }
        docs.append(json.dumps(doc, separators=(",", ":")))
    return docs


def run(name: str, tok: Any, vocab: int, docs: list[str]) -> dict[str, Any]:
    start = time.perf_counter()
    backend = make_backend(name, tok, vocab)
    setup_s = time.perf_counter() - start
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    start = time.perf_counter()
    backend.matcher(fmt)
    compile_s = time.perf_counter() - start
    mask = bitmask(1, vocab)
    fill_us: list[float] = []
    accept_us: list[float] = []
    for i, doc in enumerate(docs):
        matcher = backend.matcher(fmt)
        for token in tok.encode(doc, add_special_tokens=False):
            t0 = time.perf_counter()
            matcher.fill(mask, 0)
            t1 = time.perf_counter()
            allowed = bool((int(mask[0, token // 32]) >> (token % 32)) & 1)
            assert allowed, f"{name}: token {token} of the valid document {doc!r} is masked"
            matcher.accept(token)
            t2 = time.perf_counter()
            if i > 0:  # the first document warms up
                fill_us.append((t1 - t0) * 1e6)
                accept_us.append((t2 - t1) * 1e6)
    out = {"backend": name, "setup_s": setup_s, "compile_s": compile_s, "tokens": len(fill_us)}
    out |= {"mask_us_median": percentile(fill_us, 0.5), "mask_us_p90": percentile(fill_us, 0.9)}
    per_token = statistics.fmean(f + a for f, a in zip(fill_us, accept_us, strict=True))
    return out | {"accept_us_median": percentile(accept_us, 0.5), "per_token_us_mean": per_token}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="model.path (its tokenizer); default: --preset")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--docs", type=int, default=21)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS)
    return p


def main() -> None:
    a = parser().parse_args()
    config = ModelConfig(path=a.model) if a.model else ModelConfig(preset=a.preset)
    tok = load_tokenizer(config)
    vocab = tok.vocab_size
    docs = documents(a.docs, a.seed)
    results = []
    for name in BACKENDS:
        if not available(name):
            print(f"{name}: not installed, skipped", flush=True)
            continue
        results.append(run(name, tok, vocab, docs))
        print(f"{name}: {results[-1]}", flush=True)
    path = a.out / f"grammar_{Path(a.model).name or a.preset}.json"
    write_json(path, {**run_record("grammar_bench", vars(a)), "vocab_size": vocab, "results": results})
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
