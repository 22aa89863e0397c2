"""The shared-prefix workload's prompts: groups sharing the first ``reuse`` of each prompt, round-robin."""

from __future__ import annotations

import pytest

from bench.serving_workloads import shared_prefix_prompts as prompts_for


@pytest.mark.timeout(10)
@pytest.mark.parametrize("reuse", [0.9, 0.5, 0.0])
def test_groups_share_exactly_their_prefix_and_come_round_robin(reuse: float) -> None:
    prompts = prompts_for(reuse, 100, groups=3, group_size=4, seed=0)
    assert len(prompts) == 12 and all(len(p) == 100 for p in prompts)
    shared = int(100 * reuse)
    for i, p in enumerate(prompts):
        same_group = prompts[i % 3]  # the group's first request
        assert p[:shared] == same_group[:shared]
        if i >= 3:  # its own rest differs from its group's first
            assert p[shared:] != same_group[shared:]
    heads = {tuple(p[:shared]) for p in prompts}
    assert len(heads) == (3 if shared else 1)
    assert prompts_for(reuse, 100, 3, 4, seed=0) == prompts  # the same workload for cache on and off
