"""The parallel layout (``core.distributed.ParallelLayout``): checked once where it is built, and its rank arithmetic
against values worked out by hand. Its collectives run in tests/distributed/test_sequence_parallel.py."""

import dataclasses

import pytest

from sage_grpo.core.distributed import ParallelLayout
from sage_grpo.core.errors import UserError


def _world(world_size: int, sequence_parallel_size: int) -> list[ParallelLayout]:
    return [ParallelLayout(world_size, sequence_parallel_size, rank) for rank in range(world_size)]


def test_world_4_at_k_2_is_two_groups_of_two_consecutive_ranks():
    world = _world(4, 2)
    assert [layout.data_parallel_size for layout in world] == [2, 2, 2, 2]
    assert [layout.data_parallel_rank for layout in world] == [0, 0, 1, 1]
    assert [layout.sequence_parallel_rank for layout in world] == [0, 1, 0, 1]
    assert world[3].one_per_sequence_group(["r0", "r1", "r2", "r3"]) == ["r0", "r2"]


def test_world_8_at_k_4_and_at_k_1():
    assert [layout.data_parallel_rank for layout in _world(8, 4)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [layout.rank for layout in _world(8, 4) if layout.sequence_parallel_rank == 0] == [0, 4]
    plain = _world(8, 1)
    assert [layout.data_parallel_rank for layout in plain] == list(range(8))
    assert all(layout.sequence_parallel_rank == 0 and layout.data_parallel_size == 8 for layout in plain)
    assert plain[5].one_per_sequence_group(list(range(8))) == list(range(8))


def test_the_default_is_one_process_alone_and_calls_on_the_spot():
    alone = ParallelLayout()
    assert (alone.world_size, alone.data_parallel_size, alone.sequence_parallel_size, alone.rank) == (1, 1, 1, 0)
    assert alone.across_sequence_group(lambda: "scored") == ["scored"] and alone.sequence_share == slice(0, None, 1)
    with pytest.raises(KeyError, match="reward"):
        alone.across_sequence_group(lambda: {}["reward"])


def test_a_size_that_does_not_divide_the_world_is_one_line_naming_the_key():
    with pytest.raises(UserError, match=r"^parallel.sequence_parallel_size=3 does not divide the world size 4$"):
        ParallelLayout(4, 3, 0)


@pytest.mark.parametrize(("world_size", "size", "rank"), [(4, 0, 0), (4, 2, 4), (2, 1, -1)])
def test_an_impossible_layout_is_refused(world_size, size, rank):
    with pytest.raises(ValueError, match="no such layout"):
        ParallelLayout(world_size, size, rank)


def test_build_reads_the_launchers_world_and_checks_before_making_a_mesh(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    assert ParallelLayout.build() == ParallelLayout(4, 1, 3)
    # No process group exists here: building a mesh would fail, so the refusal must come first.
    with pytest.raises(UserError, match="sequence_parallel_size=3 does not divide the world size 4"):
        ParallelLayout.build(3)


def test_a_layout_is_fixed_once_built():
    layout = ParallelLayout(4, 2, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.sequence_parallel_size = 1


def test_a_group_without_its_mesh_says_so_instead_of_gathering():
    with pytest.raises(RuntimeError, match="no device mesh"):
        ParallelLayout(2, 2, 0).across_sequence_group(lambda: None)
    # Each rank of a group takes every K-th item of the work its group would otherwise repeat, from its place.
    shares = [ParallelLayout(4, 2, rank).sequence_share for rank in range(4)]
    assert shares == [slice(0, None, 2), slice(1, None, 2)] * 2


def test_an_adapter_that_cannot_split_its_tokens_runs_at_k_1_and_refuses_k_2():
    from tests.helpers import LinearAdapter

    adapter = LinearAdapter()
    adapter.enable_sequence_parallel(ParallelLayout(2, 1, 0))  # what the recipe asks every adapter
    with pytest.raises(UserError, match="^LinearAdapter does not split its video tokens: parallel.sequence"):
        adapter.enable_sequence_parallel(ParallelLayout(2, 2, 0))
