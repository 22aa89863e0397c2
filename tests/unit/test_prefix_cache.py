"""The engine's prefix cache: full blocks found again by their tokens, parked until evicted (LRU).

Greedy and seeded tokens with the cache on equal the cache off (colocated, chunked, overlapped,
preempted, disaggregated); a block under a lease, reserved for a transfer, or found by a hit is
never evicted or written; a request aborted part-way leaves only complete blocks in the cache;
every block comes back.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import BLOCK_SIZE, copy_blocks, disaggregated, run_to_end, tiny_engine

from moriio_ray.config_load import parse_pipeline_config
from moriio_ray.engine.block_allocator import BlockAllocator
from moriio_ray.engine.engine import Engine
from moriio_ray.engine.prefix_cache import block_keys
from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def shared_prompts(count: int, seed: int) -> list[list[int]]:
    """Groups sharing a prefix (some a whole number of blocks long), duplicates, and a prompt that
    is a prefix of another."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (40,), generator=gen).tolist()
    out = [base[:12], base[:12], base[:13], base[:33], base]
    while len(out) < count:
        keep = int(torch.randint(0, 40, (1,), generator=gen))
        tail = torch.randint(0, 256, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen)
        out.append(base[:keep] + tail.tolist())
    return out


def params_for(count: int) -> list[SamplingParams]:
    return [
        GREEDY if i % 2 else SamplingParams(max_tokens=7, temperature=1.3, seed=i, ignore_eos=True)
        for i in range(count)
    ]


def one_by_one(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """Each request alone (so later ones find the earlier ones' blocks); tokens per request."""
    got = {}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
        got.update({rid: r.tokens for rid, r in run_to_end(engine).items()})
    return got


def kv_of(engine: Engine, blocks: list[int]) -> torch.Tensor:
    """The KV of ``blocks`` (layer-major: [layers, 2, blocks, ...]), copied."""
    return engine.kv_cache[:, :, blocks].clone()


def test_the_config_key_is_on_by_default_and_checked() -> None:
    assert parse_pipeline_config({"name": "x"}).engine.enable_prefix_caching is True
    off = parse_pipeline_config({"name": "x", "engine": {"enable_prefix_caching": False}})
    assert off.engine.enable_prefix_caching is False
    with pytest.raises(ConfigError, match=r"engine\.enable_prefix_caching: Expected `bool`"):
        parse_pipeline_config({"name": "x", "engine": {"enable_prefix_caching": "yes"}})
    engine = tiny_engine(prefix_caching=False)
    engine.add_request("a", list(range(40)), GREEDY)
    run_to_end(engine)
    engine.add_request("b", list(range(40)), GREEDY)
    run_to_end(engine)
    assert engine.prefix_cache_stats() == {
        "num_cached_blocks": 0,
        "num_queried_tokens": 0,
        "num_hit_tokens": 0,
    }


def test_keys_name_the_whole_prefix() -> None:
    a, b = list(range(10)), [*range(6), 99, 7, 8, 9]
    ka, kb = block_keys(a, 4), block_keys(b, 4)
    assert len(ka) == 2 and ka[0] == kb[0] and ka[1] != kb[1]  # the partial block has no key
    assert block_keys(a[4:8], 4, ka[0]) == ka[1:]  # chained from the parent's key
    assert block_keys(a[4:8], 4) != ka[1:]  # the same tokens after another prefix


def test_allocator_parks_registered_blocks_and_evicts_the_oldest_last() -> None:
    a = BlockAllocator(4, prefix_caching=True)
    keys = block_keys(list(range(12)), 4)
    blocks = a.allocate(3)
    for block, key in zip(blocks, keys, strict=True):
        a.register(block, key)
    a.free(blocks[::-1])
    assert (a.num_free, a.num_used, a.num_cached) == (4, 0, 3)  # parked blocks count as free
    assert a.match(keys) == blocks
    a.acquire(blocks[:1])  # a hit: referenced again, out of the eviction order
    assert (a.num_free, a.acquire_cost(blocks)) == (3, 2)
    (fresh,) = a.allocate(1)  # the unregistered block goes first
    assert fresh not in blocks and a.num_cached == 3
    (evicted,) = a.allocate(1)  # then the least recently parked: the tail
    assert evicted == blocks[2] and a.match(keys) == blocks[:2]
    with pytest.raises(Exception, match="only 1 are free"):
        a.allocate(2)  # blocks[0] is referenced: never evicted
    assert a.allocate(1) == [blocks[1]] and a.match(keys) == blocks[:1]


@pytest.mark.parametrize(("budget", "overlap"), [(4096, False), (9, False), (13, True)])
def test_cached_tokens_equal_uncached(budget: int, overlap: bool) -> None:
    ps = shared_prompts(14, seed=1)
    params = params_for(len(ps))
    want = one_by_one(tiny_engine(prefix_caching=False), ps, params)
    engine = tiny_engine(max_num_seqs=4, max_num_batched_tokens=budget, overlap=overlap)
    start = engine.stats()
    assert one_by_one(engine, ps, params) == want
    stats = engine.prefix_cache_stats()
    assert stats["num_hit_tokens"] > stats["num_queried_tokens"] // 3 and stats["num_cached_blocks"] > 0
    assert engine.stats() == start  # every block free again (parked ones count as free)
    # all together too, where hits come from requests still running or just finished
    together = tiny_engine(max_num_seqs=4, max_num_batched_tokens=budget, overlap=overlap)
    for i, (prompt, p) in enumerate(zip(ps, params, strict=True)):
        together.add_request(f"r{i}", prompt, p)
    assert {rid: r.tokens for rid, r in run_to_end(together).items()} == want


def test_a_hit_skips_the_cached_blocks_and_never_writes_them() -> None:
    engine = tiny_engine()
    prompt = list(range(50, 80))  # 30 tokens: 7 full blocks and 2 tokens
    engine.add_request("a", prompt, GREEDY)
    run_to_end(engine)
    fed: list[list[int]] = []
    run = engine.runner.run

    def recording(batch, *args):  # type: ignore[no-untyped-def]
        fed.append(list(batch.q_lens))
        return run(batch, *args)

    engine.runner.run = recording  # type: ignore[method-assign]
    engine.add_request("b", prompt[:28], GREEDY)  # exactly 7 blocks: 6 hit, the 7th is fed
    engine.step()
    seq = engine._seqs["b"]
    assert fed[0] == [4] and seq.num_hit_tokens == 24
    hit_blocks = seq.block_table[:6]
    before = kv_of(engine, hit_blocks)
    run_to_end(engine)
    assert torch.equal(kv_of(engine, hit_blocks), before)


def test_blocks_under_a_lease_or_reserved_are_never_evicted_or_written() -> None:
    """A prefill engine's leased prompt (being read) and a decode engine's reservation (a transfer
    writes it, or a quarantine holds it) keep their KV while other requests churn the cache."""
    prefill = tiny_engine("prefill", num_blocks=16)
    prefill.add_request("leased", list(range(100, 120)), GREEDY)  # 5 blocks
    (handle,) = [r.prefill for r in run_to_end(prefill).values()]
    assert handle is not None
    before = kv_of(prefill, handle.block_ids)
    for i in range(12):  # each needs 3 of the 11 other blocks: the parked ones are evicted
        prefill.add_request(f"churn{i}", [(37 * i + 11 * j) % 250 for j in range(11)], GREEDY)
        for rid, r in run_to_end(prefill).items():
            assert r.prefill is not None and prefill.release(rid)
    assert torch.equal(kv_of(prefill, handle.block_ids), before)
    assert prefill.prefill_blocks("leased") == handle.block_ids

    decode = tiny_engine("decode", num_blocks=16)
    blocks = decode.reserve("held", list(range(100, 120)), GREEDY)
    assert blocks is not None and decode.cached_blocks("held") == 0
    decode.kv_cache[:, :, blocks] = 7.0  # what the transfer wrote (or may still write)
    for i in range(6):
        decode.add_request(f"churn{i}", [(37 * i + 11 * j) % 250 for j in range(11)], GREEDY)
        run_to_end(decode)
    assert bool((decode.kv_cache[:, :, blocks] == 7.0).all())
    assert decode.prefix_cache_stats()["num_cached_blocks"] > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_an_abort_mid_prefill_leaves_only_complete_blocks(overlap: bool) -> None:
    prompt = list(range(30, 90))  # 60 tokens
    want = one_by_one(tiny_engine(prefix_caching=False), [prompt], [GREEDY])
    engine = tiny_engine(max_num_seqs=4, max_num_batched_tokens=10, overlap=overlap)
    start = engine.stats()
    engine.add_request("cut", prompt, GREEDY)
    engine.step()
    engine.step()  # 20 tokens computed: 5 full blocks
    engine.abort("cut")
    assert engine.prefix_cache_stats()["num_cached_blocks"] == 20 // BLOCK_SIZE
    assert engine.stats() | {"num_preemptions": 0} == start | {"num_preemptions": 0}
    assert one_by_one(engine, [prompt], [GREEDY]) == want  # resumes from the complete blocks
    assert engine.prefix_cache_stats()["num_hit_tokens"] == 20
    # a decode engine's reservation never enters the cache unless its KV came (start_decode)
    decode = tiny_engine("decode")
    assert decode.reserve("res", prompt, GREEDY) is not None
    decode.abort("res")
    assert decode.prefix_cache_stats()["num_cached_blocks"] == 0


@pytest.mark.parametrize(
    ("held", "warm_len", "target_len", "num_held", "p_hit_tokens"),
    [
        ("none", 0, 38, 0, 0),
        ("part", 17, 38, 4, 16),
        ("all_but_the_partial_block", 38, 38, 9, 36),
        ("everything", 36, 36, 9, 32),
    ],
)
def test_pd_moves_only_the_blocks_d_lacks(
    held: str, warm_len: int, target_len: int, num_held: int, p_hit_tokens: int
) -> None:
    """Each split of a prompt between D's cache and P's transfer gives the colocated tokens; D
    holds the head, reads the tail, and the two add up to P's blocks (counts agree by
    construction). P computes only what it does not hold itself (at least the last token)."""
    tokens = list(range(60, 98))
    target = tokens[:target_len]
    want = one_by_one(tiny_engine(prefix_caching=False), [target], [GREEDY])["r0"]
    prefill, decode = tiny_engine("prefill"), tiny_engine("decode")
    if warm_len:  # an earlier request through the same P and D fills both caches
        warm = disaggregated(
            prefill, decode, [tokens[:warm_len]], [SamplingParams(max_tokens=2, ignore_eos=True)]
        )
        assert warm["r0"].finished
    start = (prefill.stats(), decode.stats())
    prefill.add_request("x", target, GREEDY)
    first = run_to_end(prefill)["x"].prefill
    assert first is not None and first.num_cached_tokens == p_hit_tokens
    blocks = decode.reserve("x", target, GREEDY)
    assert blocks is not None and len(blocks) == len(first.block_ids) == -(-target_len // BLOCK_SIZE)
    assert decode.cached_blocks("x") == num_held
    if num_held < len(blocks):
        copy_blocks(prefill, first.block_ids[num_held:], decode, blocks[num_held:])
    assert prefill.release("x")
    decode.start_decode("x", first.first_token)
    assert [first.first_token, *run_to_end(decode)["x"].tokens] == want
    assert (prefill.stats(), decode.stats()) == start
