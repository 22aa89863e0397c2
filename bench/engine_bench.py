"""Engine throughput: prefill and decode tokens/s at several batch sizes, beside plain ``transformers``.

For each batch size B the built-in engine (colocated role) takes B random prompts of --prompt-len
tokens: one ``step()`` prefills them all (one prefill batch) and samples the first tokens, then
--decode-steps ``step()`` calls decode one token per sequence each (greedy, EOS ignored). Timed:
whole engine steps (scheduling, input building, forward, sampling), wall clock between device
synchronisations (the prefill step alone; the decode steps back to back, with no synchronisation
between them), median of --repeats runs after one warm-up run that is not counted.

The baseline ("hf"), in the same run on the same device and dtype, is the ``transformers`` model of
the same architecture (its own random weights; speed does not depend on them): one forward over
the prompts (``logits_to_keep=1``), then a greedy loop of single-token forwards with its KV cache.
The two systems take turns, run by run, so that a drifting host load affects both alike.

    python bench/engine_bench.py --preset tiny --device cpu --dtype float32
    python bench/engine_bench.py --preset llama-1b --device cuda --dtype bfloat16

Writes bench/results/engine_<preset>_<device>_<dtype>.json and .png.

``--scenario long-prompt``: --running requests decode at steady state, then a --long-prompt-len
prompt arrives; their inter-token gaps before and while it is prefilled, unchunked against chunked
at each of --budgets (and, with --overlap, overlapped), in one run. ``--scenario closed-loop``:
--concurrency requests in flight of random lengths, generated tokens/s per configuration
(``bench/engine_scenarios.py``). Each writes engine_<scenario>_<preset>_<device>_<dtype>.json, .png:

    python bench/engine_bench.py --scenario long-prompt --preset tiny --threads 1
    python bench/engine_bench.py --scenario long-prompt --device cuda --preset llama-1b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for moriio_ray


from bench import engine_scenarios as scenarios
from moriio_ray.config import EngineConfig, ModelConfig
from moriio_ray.engine.arch import ModelArgs
from moriio_ray.engine.engine import Engine
from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.engine.sequence import blocks_for


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall seconds of ``fn()`` between device synchronisations, and its result."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def random_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab, 256), (batch, prompt_len), generator=gen).tolist()


# ----------------------------------------------------------------------------------------------
# the engine


# What ``--shaping`` puts on every request: the penalties and a logit bias (issue: their cost at c=64)
SHAPING: dict[str, Any] = {
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.1,
    "logit_bias": {token: 1.0 for token in range(0, 256, 16)},
}


def engine_run(
    engine: Engine, batch: int, prompt_len: int, decode_steps: int, seed: int, shaped: bool = False
) -> dict[str, float]:
    """One prefill step of ``batch`` prompts, then ``decode_steps`` decode steps; seconds and tokens.
    With overlapped scheduling a step's tokens come back with the next step: the prefill phase ends
    with the step that returns the first tokens (it launched the first decode), and the decode phase
    ends with the step that only reads the last one back."""
    params = SamplingParams(max_tokens=decode_steps + 1, ignore_eos=True, **(SHAPING if shaped else {}))
    for i, prompt in enumerate(random_prompts(batch, prompt_len, engine.args.vocab_size, seed)):
        engine.add_request(f"b{batch}-s{seed}-{i}", prompt, params)
    prefill_s, num_first = 0.0, 0
    while num_first == 0:
        step_s, outs = timed(engine.device, engine.step)
        prefill_s += step_s
        num_first = sum(len(o.new_token_ids) for o in outs)
    assert num_first == batch, "prefill was split"
    # the decode steps back to back, as a serving engine runs them: one synchronisation before and
    # one after, none between steps (a sync per step would stop overlapped scheduling from hiding
    # the host's work, and add its own latency to every step)
    num_decoded = 0
    sync(engine.device)
    start = time.perf_counter()
    while engine.has_work():
        num_decoded += sum(len(o.new_token_ids) for o in engine.step())
    sync(engine.device)
    decode_s = time.perf_counter() - start
    assert num_decoded == batch * decode_steps
    return {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "prefill_tokens": batch * prompt_len,
        "decode_tokens": num_decoded,
    }


# ----------------------------------------------------------------------------------------------
# the transformers baseline


def hf_model(args: ModelArgs, dtype: torch.dtype, device: torch.device) -> Any:
    """A ``transformers`` model with the preset's architecture (random weights), or None if unavailable."""
    try:
        import transformers
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()  # the cache-argument deprecation notices, once per step
    rope: dict[str, Any] = {"rope_type": args.rope.rope_type, "rope_theta": args.rope.theta}
    if args.rope.rope_type == "llama3":
        rope.update(
            factor=args.rope.factor,
            low_freq_factor=args.rope.low_freq_factor,
            high_freq_factor=args.rope.high_freq_factor,
            original_max_position_embeddings=args.rope.original_max_position_embeddings,
        )
    config_cls = {
        "llama": "LlamaConfig",
        "mistral": "MistralConfig",
        "qwen2": "Qwen2Config",
        "qwen3": "Qwen3Config",
    }[args.model_type]
    config = getattr(transformers, config_cls)(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_position_embeddings,
        rms_norm_eps=args.rms_norm_eps,
        tie_word_embeddings=args.tie_word_embeddings,
        rope_parameters=rope,
    )
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


@torch.inference_mode()
def hf_run(
    model: Any, batch: int, prompt_len: int, decode_steps: int, device: torch.device, seed: int
) -> dict[str, float]:
    """One forward over the prompts, then ``decode_steps`` greedy single-token forwards."""
    ids = torch.tensor(random_prompts(batch, prompt_len, model.config.vocab_size, seed), device=device)
    prefill_s, out = timed(device, lambda: model(ids, use_cache=True, logits_to_keep=1))

    def decode() -> None:
        nonlocal out
        for _ in range(decode_steps):
            token = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
            out = model(token, past_key_values=out.past_key_values, use_cache=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        decode_s, _ = timed(device, decode)
    return {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "prefill_tokens": batch * prompt_len,
        "decode_tokens": batch * decode_steps,
    }


# ----------------------------------------------------------------------------------------------


def median_rates(runs: list[dict[str, float]]) -> dict[str, float]:
    return {
        "prefill_tok_s": statistics.median(r["prefill_tokens"] / r["prefill_s"] for r in runs),
        "decode_tok_s": statistics.median(r["decode_tokens"] / r["decode_s"] for r in runs),
        "prefill_s": statistics.median(r["prefill_s"] for r in runs),
        "decode_step_ms": statistics.median(1e3 * r["decode_s"] for r in runs)
        / max(1, runs[0]["decode_steps"]),
    }


def measure(
    runs: dict[str, Callable[[int], dict[str, float]]], repeats: int, decode_steps: int
) -> dict[str, dict[str, float]]:
    """Median rates of each system; the systems take turns, so drifting host load hits both alike."""
    for run in runs.values():
        run(-1)  # warm-up (and CUDA-graph capture), not counted
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    for i in range(repeats):
        for name, run in runs.items():
            r = run(i)
            r["decode_steps"] = decode_steps
            samples[name].append(r)
    return {name: median_rates(rs) for name, rs in samples.items()}


def plot(results: list[dict[str, Any]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    batches = [r["batch_size"] for r in results]
    xs = range(len(batches))
    for ax, key, name in zip(axes, ("prefill_tok_s", "decode_tok_s"), ("prefill", "decode"), strict=True):
        ours = [r["engine"][key] for r in results]
        ax.bar([x - 0.2 for x in xs], ours, width=0.4, label="moriio-ray engine")
        if all(r.get("hf") for r in results):
            base = [r["hf"][key] for r in results]
            ax.bar([x + 0.2 for x in xs], base, width=0.4, label="transformers")
            for x, a, b in zip(xs, ours, base, strict=True):
                ax.annotate(f"{a / b:.2f}x", (x - 0.2, a), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), [str(b) for b in batches])
        ax.set_xlabel("batch size")
        ax.set_ylabel("tokens/s")
        ax.set_yscale("log")
        ax.set_title(f"{name} throughput")
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scenario", default="throughput", choices=["throughput", "long-prompt", "closed-loop"]
    )
    parser.add_argument("--running", type=int, default=16, help="long-prompt: requests decoding")
    parser.add_argument("--running-prompt-len", type=int, default=128)
    parser.add_argument("--long-prompt-len", type=int, default=4096)
    parser.add_argument("--budgets", default="256,512", help="chunked configurations' token budgets")
    parser.add_argument("--unchunked-budget", type=int, default=4096)
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="overlapped scheduling (scenarios: each configuration both ways)",
    )
    parser.add_argument("--concurrency", type=int, default=16, help="closed-loop: requests in flight")
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--prompt-range", type=int, nargs=2, default=[32, 512])
    parser.add_argument("--output-range", type=int, nargs=2, default=[16, 128])
    parser.add_argument("--tag", default="", help="suffix of the result files")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,32,128")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layout", default="layer_major", choices=["layer_major", "block_major"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly on CUDA")
    parser.add_argument(
        "--kernels", default="auto", choices=["auto", "torch", "triton"], help="engine.kernels"
    )
    parser.add_argument(
        "--baseline-kernels",
        default="",
        choices=["", "torch", "triton"],
        help="also run an engine with these kernels, side by side (series engine-<kernels>)",
    )
    parser.add_argument(
        "--shaping",
        action="store_true",
        help="also run the engine with penalties and logit_bias on every request (series engine-shaped)",
    )
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = parser.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)  # on a shared host, spinning OpenMP threads distort timings
    if a.scenario != "throughput":
        scenarios.main(a)
        return
    batches = [int(b) for b in a.batch_sizes.split(",")]
    max_batch = max(batches)
    # blocks for the largest batch (with the warm-up's requests gone by then), plus slack
    num_blocks = max_batch * blocks_for(a.prompt_len + a.decode_steps + 1, a.block_size) + 16
    print(
        f"building engine: preset={a.preset} device={a.device} dtype={a.dtype} blocks={num_blocks}",
        flush=True,
    )

    def build(kernels: str) -> Engine:
        return Engine(
            ModelConfig(preset=a.preset, dtype=a.dtype, max_model_len=a.prompt_len + a.decode_steps + 8),
            EngineConfig(
                device=a.device,
                block_size=a.block_size,
                num_blocks=num_blocks,
                layout=a.layout,
                max_num_seqs=max_batch,
                max_num_batched_tokens=max_batch * a.prompt_len,
                kernels=kernels,
                **({"overlap_scheduling": True} if a.overlap else {}),  # else the engine's default
            ),
            role="colocated",
            cuda_graphs=not a.no_cuda_graphs,
        )

    build_s, engine = timed(torch.device("cpu"), lambda: build(a.kernels))
    print(f"  built in {build_s:.1f} s", flush=True)
    baseline = build(a.baseline_kernels) if a.baseline_kernels else None
    hf = None if a.no_hf else hf_model(engine.args, engine.dtype, engine.device)
    load_before = os.getloadavg()  # other processes on the host distort CPU timings: keep a record
    results = []
    for batch in batches:
        systems: dict[str, Callable[[int], dict[str, float]]] = {
            "engine": functools.partial(engine_run, engine, batch, a.prompt_len, a.decode_steps)
        }
        if a.shaping:
            systems["engine-shaped"] = functools.partial(
                engine_run, engine, batch, a.prompt_len, a.decode_steps, shaped=True
            )
        if baseline is not None:
            systems[f"engine-{a.baseline_kernels}"] = functools.partial(
                engine_run, baseline, batch, a.prompt_len, a.decode_steps
            )
        if hf is not None:
            systems["hf"] = functools.partial(hf_run, hf, batch, a.prompt_len, a.decode_steps, engine.device)
        print(f"batch {batch}: {' and '.join(systems)}, {a.repeats} turns each ...", flush=True)
        row: dict[str, Any] = {"batch_size": batch, **measure(systems, a.repeats, a.decode_steps)}
        for name in systems:
            print(
                f"  {name}: prefill {row[name]['prefill_tok_s']:,.0f} tok/s, "
                f"decode {row[name]['decode_tok_s']:,.0f} tok/s",
                flush=True,
            )
        if a.shaping:
            cost = 1 - row["engine-shaped"]["decode_tok_s"] / row["engine"]["decode_tok_s"]
            row["shaping_decode_cost"] = cost
            print(f"  shaping (penalties + logit_bias on every request): decode cost {cost:.1%}")
        if hf is not None:
            row["ratio"] = {k: row["engine"][k] / row["hf"][k] for k in ("prefill_tok_s", "decode_tok_s")}
            ratio = row["ratio"]
            print(f"  engine/hf: prefill {ratio['prefill_tok_s']:.2f}x, decode {ratio['decode_tok_s']:.2f}x")
        results.append(row)
        assert engine.stats()["num_used_blocks"] == 0
    env = scenarios.environment(engine, load_before)
    name = f"engine_{a.preset}_{a.device}_{a.dtype}{'_eager' if a.no_cuda_graphs else ''}"
    stem = scenarios.write_report(a, name, env, engine_build_s=build_s, results=results)
    title = (
        f"{a.preset} {a.dtype} on {env['device'] or a.device}: prompt {a.prompt_len}, "
        f"{a.decode_steps} decode steps, median of {a.repeats}"
    )
    plot(results, title, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and {stem}.png", flush=True)


if __name__ == "__main__":
    main()
