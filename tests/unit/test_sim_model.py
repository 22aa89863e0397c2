"""The simulated model (``model.preset: sim``): deterministic tokens read back from the KV cache, the
configured step time without burning CPU, PD parity through block copies and through real transfer
agents (READ and WRITE), a wrong or missing block changing the tokens, and its config."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from engine_helpers import Result, copy_blocks, disaggregated, prompts_for_block_size, run_to_end

from moriio_ray.config import EngineConfig, ModelConfig, SimConfig, TransferConfig
from moriio_ray.config_load import parse_pipeline_config
from moriio_ray.engine.batch import PrefillChunk
from moriio_ray.engine.engine import Engine
from moriio_ray.engine.presets import BYTE_VOCAB_SIZE
from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.engine.sequence import blocks_for
from moriio_ray.engine.sim_model import FIRST_ID, NUM_IDS, SimEvent, sim_device, step_s
from moriio_ray.errors import ConfigError
from moriio_ray.transfer import create_agent
from moriio_ray.transfer.base import Transfer, TransferAgent
from moriio_ray.transfer.plan import plan_blocks

BLOCK_SIZE = 4
FAST = SimConfig(step_fixed_ms=0.05, step_per_decode_row_us=0.0, step_per_prefill_token_us=0.0)


def sim_engine(
    role: str = "colocated",
    *,
    sim: SimConfig = FAST,
    layout: str = "layer_major",
    dtype: str = "auto",
    overlap: bool | None = None,
    agent: TransferAgent | None = None,
    num_blocks: int = 128,
    max_num_batched_tokens: int = 4096,
) -> Engine:
    """A sim Engine on the CPU with the default (llama-1b) KV geometry and small blocks."""
    return Engine(
        ModelConfig(preset="sim", dtype=dtype, sim=sim),
        EngineConfig(
            device="cpu",
            block_size=BLOCK_SIZE,
            num_blocks=num_blocks,
            layout=layout,
            max_num_seqs=16,
            max_num_batched_tokens=max_num_batched_tokens,
            overlap_scheduling=overlap,
        ),
        role=role,
        agent=agent,
    )


def colocated(prompts: list[list[int]], params: list[SamplingParams], **kw: Any) -> dict[str, Result]:
    engine = sim_engine(**kw)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    return run_to_end(engine)


# -- tokens ------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_colocated_tokens_are_deterministic_and_depend_on_the_prompt() -> None:
    prompts = prompts_for_block_size(BLOCK_SIZE, count=8)
    params = [SamplingParams(max_tokens=12)] * len(prompts)  # EOS not ignored: greedy never picks it
    first, again = colocated(prompts, params), colocated(prompts, params, max_num_batched_tokens=16)
    assert {r: x.tokens for r, x in first.items()} == {r: x.tokens for r, x in again.items()}
    for res in first.values():
        assert res.finish_reason == "length" and len(res.tokens) == 12
        assert all(FIRST_ID <= t < FIRST_ID + NUM_IDS for t in res.tokens)  # printable ASCII
    # one byte changed anywhere in the prompt changes what follows
    changed = [[*p[:-1], (p[-1] + 1) % 256] for p in prompts[1:4]] + [
        [(prompts[4][0] + 1) % 256, *prompts[4][1:]]
    ]
    other = colocated(changed, params[: len(changed)])
    for i in range(len(changed)):
        assert other[f"r{i}"].tokens != first[f"r{i + 1}"].tokens


@pytest.mark.timeout(60)
def test_sampling_features_run_through_the_real_sampler() -> None:
    prompts = prompts_for_block_size(BLOCK_SIZE, count=6, seed=3)
    greedy = colocated(prompts, [SamplingParams(max_tokens=10, logprobs=True)] * 6)
    seeded = [SamplingParams(max_tokens=10, temperature=1.5, top_k=50, seed=7 + i) for i in range(6)]
    a, b = colocated(prompts, seeded), colocated(prompts, seeded)
    assert all(a[r].tokens == b[r].tokens for r in a)
    assert sum(a[r].tokens != greedy[r].tokens for r in a) >= 4  # a real distribution to sample from
    for res in greedy.values():  # the picked id leads the spread by a clear margin
        assert all(-0.3 < lp < 0 for lp in res.logprobs)
    bias = colocated(prompts[:1], [SamplingParams(max_tokens=5, logit_bias={65: 100.0})])
    assert bias["r0"].tokens == [65] * 5


@pytest.mark.timeout(60)
def test_prompt_logprobs_are_the_same_in_chunks() -> None:
    prompt = [(7 * i) % 256 for i in range(40)]
    found = []
    for budget in (4096, 16):  # one prefill step; chunks of 16 tokens
        engine = sim_engine(max_num_batched_tokens=budget)
        engine.add_request("r", prompt, SamplingParams(max_tokens=3, prompt_logprobs=2))
        outs = [o for _ in range(20) for o in engine.step() if o.prompt_logprobs is not None]
        assert len(outs) == 1 and outs[0].prompt_logprobs is not None
        found.append(outs[0].prompt_logprobs)
    assert found[0] == found[1]
    logprobs, tops = found[0].logprobs, found[0].top
    assert len(logprobs) == len(prompt) and logprobs[0] is None and all(len(t) == 2 for t in tops[1:])
    assert all(FIRST_ID <= t[0][0] < FIRST_ID + NUM_IDS for t in tops[1:])  # the checksums' picks


# -- timing ------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_step_time_is_the_configured_one_and_the_wait_burns_no_cpu() -> None:
    sim = SimConfig(step_fixed_ms=20.0, step_per_decode_row_us=500.0, step_per_prefill_token_us=100.0)
    rows, num_steps = 8, 10
    decode_s = step_s(sim, rows, 0)
    assert decode_s == pytest.approx(0.024) and step_s(sim, 0, 10) == pytest.approx(0.021)
    assert sim_engine(sim=sim).overlap  # on by default, as for CUDA engines
    engine = sim_engine(sim=sim, overlap=False)  # each step() waits for its own step: exact timing
    for i in range(rows):
        engine.add_request(f"r{i}", [1 + i, 2, 3], SamplingParams(max_tokens=num_steps + 5))
    engine.step()  # the prefill
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(num_steps):
        assert len(engine.step()) == rows
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert wall >= num_steps * decode_s
    assert cpu < 0.5 * wall, f"{cpu:.3f} s of CPU in {wall:.3f} s"
    # overlapped (the default): a whole run still lasts at least its steps' device time
    engine = sim_engine(sim=sim)
    prefill_s = step_s(sim, 0, 3 * rows)
    start = time.perf_counter()
    for i in range(rows):
        engine.add_request(f"r{i}", [1 + i, 2, 3], SamplingParams(max_tokens=num_steps + 1))
    assert sum(len(r.tokens) for r in run_to_end(engine).values()) == rows * (num_steps + 1)
    assert time.perf_counter() - start >= prefill_s + num_steps * decode_s


@pytest.mark.timeout(30)
def test_a_reservation_waits_for_the_step_in_flight() -> None:
    sim = SimConfig(step_fixed_ms=200.0, step_per_decode_row_us=0.0, step_per_prefill_token_us=0.0)
    engine = sim_engine("decode", sim=sim)
    engine.add_request("busy", [1, 2, 3], SamplingParams(max_tokens=4))  # (a decode engine's recompute)
    start = time.monotonic()
    assert engine.step() == []  # launched, in flight: its outputs come with the next step
    in_flight = engine._in_flight
    assert in_flight is not None and isinstance(in_flight.event, SimEvent)
    assert engine.reserve("r", [5, 6, 7], SamplingParams(max_tokens=2)) is not None
    assert time.monotonic() - start >= 0.2 and in_flight.event.query()


# -- prefill/decode ------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("p_layout", "d_layout", "dtype"),
    [
        ("layer_major", "layer_major", "auto"),
        ("layer_major", "block_major", "auto"),
        ("block_major", "block_major", "bfloat16"),
    ],
)
def test_pd_equals_colocated(p_layout: str, d_layout: str, dtype: str) -> None:
    prompts = prompts_for_block_size(BLOCK_SIZE, count=10, seed=1)
    params = [
        SamplingParams(max_tokens=8, logprobs=True)
        if i % 2
        else SamplingParams(max_tokens=8, temperature=1.0, seed=i)
        for i in range(len(prompts))
    ]
    prefill = sim_engine("prefill", layout=p_layout, dtype=dtype, max_num_batched_tokens=16)
    decode = sim_engine("decode", layout=d_layout, dtype=dtype)
    got = disaggregated(prefill, decode, prompts, params)
    want = colocated(prompts, params, dtype=dtype)
    for rid in want:
        assert got[rid].tokens == want[rid].tokens, rid
        torch.testing.assert_close(got[rid].logprobs, want[rid].logprobs, atol=1e-5, rtol=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", ["wrong block", "uncopied block", "stale block"])
def test_a_wrong_or_missing_block_changes_the_tokens(fault: str) -> None:
    """The markers matter: D decodes from what its cache holds, so a transfer fault shows. A wrong
    block is another prompt's; an uncopied one holds zeros; a stale one the KV of an earlier
    reservation of the same block."""
    prompt = [(11 * i + 3) % 256 for i in range(18)]  # 5 blocks, the last one partial
    other = [(t + 1) % 256 for t in prompt]
    params = SamplingParams(max_tokens=8)
    want = colocated([prompt], [params])["r0"].tokens
    # D has just room for one request: a second reservation reuses the first one's blocks
    prefill, decode = (
        sim_engine("prefill"),
        sim_engine("decode", num_blocks=blocks_for(len(prompt) + 8, BLOCK_SIZE)),
    )
    prefill.add_request("r", prompt, params)
    prefill.add_request("o", other, params)
    firsts = run_to_end(prefill)
    src, src_other = firsts["r"].prefill, firsts["o"].prefill
    assert src is not None and src_other is not None
    if fault == "stale block":
        earlier = decode.reserve("o", other, params)
        assert earlier is not None
        copy_blocks(prefill, src_other.block_ids, decode, earlier)
        decode.abort("o")
    dst = decode.reserve("r", prompt, params)
    assert dst is not None and decode.cached_blocks("r") == 0
    blocks, skip = list(src.block_ids), None
    if fault == "wrong block":
        blocks[1] = src_other.block_ids[1]
    elif fault == "uncopied block":
        skip = 1
    else:
        skip = next(i for i, b in enumerate(dst) if any(k[b].abs().sum() > 0 for k, _ in decode.cache.layers))
    kept = [i for i in range(len(dst)) if i != skip]
    copy_blocks(prefill, [blocks[i] for i in kept], decode, [dst[i] for i in kept])
    decode.start_decode("r", src.first_token)
    got = [src.first_token, *run_to_end(decode)["r"].tokens]
    assert got[0] == want[0] and len(got) == len(want) and got != want


@contextmanager
def agents(backend: str) -> Iterator[tuple[TransferAgent, TransferAgent]]:
    p, d = (create_agent(TransferConfig(backend=backend), key) for key in ("sim-p", "sim-d"))
    try:
        p.connect(d.engine_desc())
        d.connect(p.engine_desc())
        yield p, d
    finally:
        p.close()
        d.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["shm", "tcp"])
@pytest.mark.parametrize("mode", ["read", "write"])
def test_pd_through_real_agents_equals_colocated(backend: str, mode: str) -> None:
    """READ: D pulls P's leased blocks; WRITE: P pushes each layer from its layer hook, as it is
    written, into D's reserved blocks. Either way D's tokens are the colocated ones."""
    prompts = prompts_for_block_size(BLOCK_SIZE, count=6, seed=4)
    params = SamplingParams(max_tokens=6)
    want = colocated(prompts, [params] * len(prompts))
    with agents(backend) as (pa, da):
        prefill = sim_engine("prefill", agent=pa, max_num_batched_tokens=16)
        decode = sim_engine("decode", agent=da, layout="block_major")
        assert prefill.kv_mem is not None and decode.kv_mem is not None
        p_mem, d_mem = prefill.kv_mem, decode.kv_mem
        reserved: dict[str, list[int]] = {}
        first_tokens: dict[str, int] = {}
        pushes: list[Transfer] = []
        layers: list[int] = []

        def push(layer: int, chunks: list[PrefillChunk]) -> None:
            layers.append(layer)
            for chunk in chunks:
                first, end = chunk.ready_blocks(BLOCK_SIZE)
                src = prefill.prefill_blocks(chunk.request_id)[first:end]
                plan = plan_blocks(
                    src,
                    reserved[chunk.request_id][first:end],
                    prefill.layout,
                    decode.layout,
                    range(layer, layer + 1),
                )
                if src:
                    pushes.append(pa.write(p_mem, d_mem, plan))

        if mode == "write":
            prefill.set_layer_hook(push)
        for i, prompt in enumerate(prompts):
            if mode == "write":
                blocks = decode.reserve(f"r{i}", prompt, params)
                assert blocks is not None
                reserved[f"r{i}"] = blocks
            prefill.add_request(f"r{i}", prompt, params)
        firsts = run_to_end(prefill)
        for i, prompt in enumerate(prompts):
            rid = f"r{i}"
            handle = firsts[rid].prefill
            assert handle is not None
            if mode == "read":
                dst = decode.reserve(rid, prompt, params)
                assert dst is not None
                plan = plan_blocks(dst, handle.block_ids, decode.layout, prefill.layout)
                da.read(d_mem, p_mem, plan).wait(10.0)
            else:
                for xfer in pushes:
                    xfer.wait(10.0)
            assert prefill.release(rid)
            decode.start_decode(rid, handle.first_token)
            first_tokens[rid] = handle.first_token
        rest = run_to_end(decode)
        if mode == "write":
            num_layers = prefill.layout.num_layers
            assert layers == list(range(num_layers)) * (len(layers) // num_layers) and layers
        for rid, res in want.items():
            assert [first_tokens[rid], *rest[rid].tokens] == res.tokens, rid
        decode.close()
        prefill.close()


# -- config ------------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_config_of_the_sim_model() -> None:
    config = parse_pipeline_config({"model": {"preset": "sim"}})
    assert config.model.sim == SimConfig() and config.model.name == "sim"
    assert SimConfig().vocab_size == BYTE_VOCAB_SIZE  # the byte tokenizer's ids
    tuned = parse_pipeline_config(
        {"model": {"preset": "sim", "sim": {"step_fixed_ms": 0.5, "num_layers": 4}}}
    )
    assert tuned.model.sim is not None and tuned.model.sim.num_layers == 4
    cases = [
        ({"model": {"preset": "tiny", "sim": {}}}, "model.sim: only the simulated model takes it"),
        ({"model": {"path": "x", "sim": {}}}, "model.sim: only the simulated model takes it"),
        (
            {"model": {"preset": "sim", "sim": {"step_fixed_ms": -1}}},
            "model.sim.step_fixed_ms: -1.0 must be >= 0.0",
        ),
        (
            {"model": {"preset": "sim", "sim": {"step_per_prefill_token_us": -0.1}}},
            "model.sim.step_per_prefill_token_us: -0.1 must be >= 0.0",
        ),
        (
            {"model": {"preset": "sim", "sim": {"vocab_size": 100}}},
            "model.sim.vocab_size: 100 must be >= 260",
        ),
        ({"model": {"preset": "sim", "sim": {"head_dim": 0}}}, "model.sim.head_dim: 0 must be >= 1"),
        ({"model": {"preset": "sim", "sim": {"layers": 2}}}, "model.sim.layers: unknown field"),
        (
            {"model": {"preset": "sim"}, "pool": {"decode": {"tensor_parallel_size": 2}}},
            "pool.decode.tensor_parallel_size: 2: the simulated model",
        ),
        (
            {"model": {"preset": "sim"}, "transfer": {"backend": "cuda_ipc"}},
            "transfer.backend: 'cuda_ipc' moves GPU memory",
        ),
    ]
    for data, message in cases:
        with pytest.raises(ConfigError) as info:
            parse_pipeline_config(data)
        assert str(info.value).startswith(message), str(info.value)
    with pytest.raises(ConfigError, match=r"engine\.device: 'cuda' with model\.preset sim"):
        sim_device("cuda")
    assert sim_device("auto").type == "cpu"


@pytest.mark.timeout(30)
def test_the_kv_geometry_is_configurable() -> None:
    sim = SimConfig(step_fixed_ms=0.0, num_layers=3, num_kv_heads=2, head_dim=8, vocab_size=300)
    engine = sim_engine(sim=sim, layout="block_major", dtype="bfloat16")
    assert engine.layout.num_layers == 3 and engine.layout.num_kv_heads == 2 and engine.layout.head_dim == 8
    assert engine.kv_cache.dtype == torch.bfloat16 and engine.args.vocab_size == 300
    engine.add_request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4))
    assert len(run_to_end(engine)["r"].tokens) == 4
