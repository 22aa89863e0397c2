"""A request that faults in the engine reaches only its own caller, as a typed error; the worker's
engine loop keeps serving the others (EngineWorker driven in-process, no Ray)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from moriio_ray.config_load import parse_pipeline_config
from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.errors import RequestFailed
from moriio_ray.protocol import wire
from moriio_ray.protocol.messages import GenRequest, Handoff, OutputBatch, RequestOutput
from moriio_ray.worker.actor import EngineWorker

PROMPTS = [[72, 101, 108, 108, 111], [87, 111, 114, 108, 100, 33], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)
FAULTY = SamplingParams(max_tokens=10, ignore_eos=True, stop=["never-there"])
_decoder = msgspec.msgpack.Decoder(OutputBatch)


def _worker(role: str, name: str) -> EngineWorker:
    cfg = parse_pipeline_config(
        {
            "name": name,
            "model": {"preset": "tiny", "seed": 0},
            "engine": {"device": "cpu", "num_blocks": 64, "block_size": 16},
            "transfer": {"backend": "tcp"},
        }
    )
    return EngineWorker(cfg, role, f"{name}-{role}-0")


def _fail_long_decodes(worker: EngineWorker, mp: pytest.MonkeyPatch) -> None:
    """The stop check of a request with a stop string decodes its tail: fail it at 4 tokens."""
    tokenizer = worker.core.engine.tokenizer
    real = tokenizer.decode

    def decode(ids: list[int]) -> str:
        if len(ids) >= 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(ids)

    mp.setattr(tokenizer, "decode", decode)


async def _collect(worker: EngineWorker, caller: str, rids: set[str]) -> dict[str, list[RequestOutput]]:
    """Read the caller's output stream until every request in ``rids`` has ended."""
    got: dict[str, list[RequestOutput]] = {rid: [] for rid in rids}
    open_rids = set(rids)
    while open_rids:
        stream = worker.outputs(caller)
        async for item in stream:
            for out in _decoder.decode(item).items:
                got[out.request_id].append(out)
                if out.finished:
                    open_rids.discard(out.request_id)
            if not open_rids:
                break
        await stream.aclose()  # type: ignore[attr-defined]
    return got


async def _colocated_run(worker: EngineWorker, faulty: int | None) -> dict[str, Any]:
    await worker.ready()
    caller = "caller-1"
    reqs = [
        GenRequest(request_id=f"r{i}", prompt_token_ids=p, params=FAULTY if i == faulty else PARAMS)
        for i, p in enumerate(PROMPTS)
    ]
    packed = await asyncio.gather(*(worker.generate(wire.pack(r), caller) for r in reqs))
    firsts = [wire.unpack(f, RequestOutput) for f in packed]
    streamed = await asyncio.wait_for(_collect(worker, caller, {r.request_id for r in reqs}), 30)
    tokens = {f.request_id: [*f.token_ids] for f in firsts}
    for rid, outs in streamed.items():
        tokens[rid] += [t for o in outs for t in o.token_ids]
    errors = {rid: o.error for rid, outs in streamed.items() for o in outs if o.error is not None}
    stats = await worker.stats()
    await worker.shutdown()
    return {"tokens": tokens, "errors": errors, "stats": stats}


@pytest.mark.timeout(60)
def test_the_error_reaches_only_its_caller_and_the_engine_goes_on() -> None:
    clean = asyncio.run(_colocated_run(_worker("colocated", "iso-clean"), faulty=None))
    assert not clean["errors"]
    worker = _worker("colocated", "iso-fault")
    with pytest.MonkeyPatch.context() as mp:
        _fail_long_decodes(worker, mp)
        out = asyncio.run(_colocated_run(worker, faulty=1))
    assert set(out["errors"]) == {"r1"}
    kind, message = out["errors"]["r1"]
    assert kind == "RequestFailed" and "r1" in message
    assert out["tokens"]["r1"] == clean["tokens"]["r1"][:3]
    for rid in ("r0", "r2"):
        assert out["tokens"][rid] == clean["tokens"][rid] and len(out["tokens"][rid]) == 10
    stats = out["stats"]
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["live_requests"] == 0


@pytest.mark.timeout(60)
def test_a_prefill_that_faults_fails_its_call_only() -> None:
    async def run() -> tuple[list[Any], dict[str, Any]]:
        await worker.ready()
        reqs = [
            GenRequest(request_id=f"p{i}", prompt_token_ids=p, params=PARAMS if i != 1 else FAULTY)
            for i, p in enumerate(PROMPTS)
        ]
        results = await asyncio.gather(*(worker.prefill(wire.pack(r)) for r in reqs), return_exceptions=True)
        for r, res in zip(reqs, results, strict=True):
            if not isinstance(res, BaseException):
                assert await worker._side_p().release(r.request_id)
        stats = await worker.stats()
        await worker.shutdown()
        return results, stats

    worker = _worker("prefill", "iso-p")

    def decode(ids: list[int]) -> str:  # only the request with a stop string decodes: it fails
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(worker.core.engine.tokenizer, "decode", decode)
        results, stats = asyncio.run(run())
    assert isinstance(results[1], RequestFailed), results[1]
    handles = [wire.unpack(r, Handoff) for r in (results[0], results[2])]
    assert all(h.block_ids for h in handles)
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["live_requests"] == 0
