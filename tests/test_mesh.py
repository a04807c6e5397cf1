"""The process groups of a run: each one its ranks need, none made twice (every gloo group keeps
a thread that wakes every 10 ms), and each one spanning exactly its ranks."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from fxpipe.runtime.communication.mesh import Mesh, make_groups
from tests.ranks import spawn

pytestmark = pytest.mark.distributed


def _sum_over(group: Any) -> float:
    """The sum of (rank + 1) over the ranks of `group`."""
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value, group=group)
    return float(value)


def _groups_on_ranks(rank: int, world: int) -> dict[str, Any]:
    world_group = dist.group.WORLD
    # one pipeline of 4 stages: ties over stages 0 and 3 (twice) and over every stage
    one = make_groups(Mesh((0, 1, 2, 3), 1, rank),
                      {"a": [0, 3], "b": [0, 3], "everywhere": [0, 1, 2, 3]})
    # two replicas of 2 stages: a tie over both stages of each replica
    two = make_groups(Mesh((0, 1), 2, rank), {"tied": [0, 1]})
    out: dict[str, Any] = {
        "pp_is_world": one.pp is world_group, "dp": one.dp,
        "everywhere_is_world": one.shared["everywhere"] is world_group,
        "two_pp_is_world": two.pp is world_group,
        "two_sums": (_sum_over(two.pp), _sum_over(two.dp), _sum_over(two.shared["tied"])),
    }
    if rank in (0, 3):
        out["a_is_b"] = one.shared["a"] is one.shared["b"]
        out["a_is_world"] = one.shared["a"] is world_group
        out["a_sum"] = _sum_over(one.shared["a"])
    else:
        out["holds_a"] = "a" in one.shared
    return out


def test_groups_span_their_ranks_and_none_is_made_twice():
    ranks = spawn(4, __name__, "_groups_on_ranks", timeout=60, bound=240)
    for rank, out in enumerate(ranks):
        # a single pipeline over every rank runs on the default group, and so does a tie
        # that every rank holds
        assert out["pp_is_world"] and out["everywhere_is_world"], (rank, out)
        assert out["dp"] is None
        if rank in (0, 3):  # two ties over the same ranks share one group of exactly those
            assert out["a_is_b"] and not out["a_is_world"]
            assert out["a_sum"] == 1 + 4
        else:
            assert out["holds_a"] is False
        # 2 replicas x 2 stages: a "pp" row, a "dp" column, the tie within the replica
        replica, pipe_rank = divmod(rank, 2)
        row = sum(r + 1 for r in (2 * replica, 2 * replica + 1))
        column = sum(r + 1 for r in (pipe_rank, pipe_rank + 2))
        assert not out["two_pp_is_world"]
        assert out["two_sums"] == (row, column, row), (rank, out)
