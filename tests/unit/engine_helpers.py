"""Shared helpers for the engine tests: tiny engines, running them dry, and a P -> D block copy."""

from __future__ import annotations

import dataclasses

import torch

from moriio_ray.config import EngineConfig, ModelConfig
from moriio_ray.engine.engine import Engine
from moriio_ray.engine.outputs import PrefillResult
from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.transfer.plan import plan_blocks

BLOCK_SIZE = 4


def tiny_engine(
    role: str = "colocated",
    *,
    layout: str = "layer_major",
    num_blocks: int = 256,
    block_size: int = BLOCK_SIZE,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 4096,
    max_model_len: int | None = None,
    lease_grace_s: float = 5.0,
    lease_s: float = 30.0,
    chunked_prefill: bool = True,
    overlap: bool = False,
    prefix_caching: bool = True,
) -> Engine:
    """An Engine over the ``tiny`` preset on CPU in float32 (``overlap``: overlapped scheduling)."""
    return Engine(
        ModelConfig(preset="tiny", dtype="float32", seed=0, max_model_len=max_model_len),
        EngineConfig(
            device="cpu",
            block_size=block_size,
            num_blocks=num_blocks,
            layout=layout,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            chunked_prefill=chunked_prefill,
            overlap_scheduling=overlap,
            enable_prefix_caching=prefix_caching,
        ),
        role=role,
        lease_grace_s=lease_grace_s,
        lease_s=lease_s,
    )


@dataclasses.dataclass
class Result:
    """Everything one request produced."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    finished: bool = False
    prefill: PrefillResult | None = None


def run_to_end(engine: Engine, max_steps: int = 10_000) -> dict[str, Result]:
    """Step until the engine has no work; the outputs gathered per request."""
    results: dict[str, Result] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return results
        for out in engine.step():
            res = results.setdefault(out.request_id, Result())
            assert not res.finished, f"{out.request_id} produced output after finishing"
            res.tokens += out.new_token_ids
            res.logprobs += out.logprobs or []
            res.finished, res.finish_reason = out.finished, out.finish_reason
            res.prefill = out.prefill or res.prefill
    raise AssertionError(f"engine still has work after {max_steps} steps: {engine.stats()}")


def prompts_for_block_size(block_size: int, count: int = 20, seed: int = 0) -> list[list[int]]:
    """``count`` random byte prompts whose lengths include 1, one block, two blocks and one block + 1."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, block_size, 2 * block_size, block_size + 1, 3 * block_size - 1]
    lengths += torch.randint(2, 6 * block_size, (count - len(lengths),), generator=gen).tolist()
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def copy_blocks(src: Engine, src_blocks: list[int], dst: Engine, dst_blocks: list[int]) -> int:
    """Copy KV blocks between two engines' caches as a transfer agent would: plan byte segments with
    ``plan_blocks`` and copy them between the raw bytes of the two cache tensors. Returns the bytes."""
    plan = plan_blocks(dst_blocks, src_blocks, dst.layout, src.layout)
    dst_bytes = dst.kv_cache.view(-1).view(torch.uint8)
    src_bytes = src.kv_cache.view(-1).view(torch.uint8)
    for lo, ro, size in zip(
        plan.local_offsets.tolist(), plan.remote_offsets.tolist(), plan.sizes.tolist(), strict=True
    ):
        dst_bytes[lo : lo + size] = src_bytes[ro : ro + size]
    return plan.num_bytes


def disaggregated(
    prefill: Engine, decode: Engine, prompts: list[list[int]], params: list[SamplingParams]
) -> dict[str, Result]:
    """Run prompts P -> copy blocks -> D, as the runtime does; the full token streams per request.
    Only the blocks D does not hold in its prefix cache are copied (the tail of the prompt)."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        prefill.add_request(f"r{i}", prompt, p)
    firsts = run_to_end(prefill)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        rid = f"r{i}"
        handle = firsts[rid].prefill
        assert handle is not None and firsts[rid].finished
        dst_blocks = decode.reserve(rid, prompt, p)
        assert dst_blocks is not None and len(dst_blocks) == len(handle.block_ids)
        held = decode.cached_blocks(rid)
        if held < len(dst_blocks):
            copy_blocks(prefill, handle.block_ids[held:], decode, dst_blocks[held:])
        assert prefill.release(rid)
        decode.start_decode(rid, handle.first_token)
    rest = run_to_end(decode)
    return {rid: with_first(firsts[rid], rest.get(rid)) for rid in firsts}


def with_first(first: Result, rest: Result | None) -> Result:
    """A disaggregated request as its caller sees it: P's first token, then D's tokens."""
    assert first.prefill is not None
    out = Result(tokens=[first.prefill.first_token], prefill=first.prefill)
    if first.prefill.first_logprob is not None:
        out.logprobs = [first.prefill.first_logprob]
    if rest is not None:
        out.tokens += rest.tokens
        out.logprobs += rest.logprobs
        out.finished, out.finish_reason = rest.finished, rest.finish_reason
    return out
