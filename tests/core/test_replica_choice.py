"""The prefix-affinity rule (core/replica_choice.py) shared by DataParallelEngine and the Ray
Serve router."""
from __future__ import annotations

import pytest

from jaxbatch.core.replica_choice import choose_replica, rank_replicas


def test_no_match_anywhere_is_least_loaded_lowest_index_on_ties():
    assert choose_replica([3, 1, 2], [0, 0, 0], max_imbalance=10) == 1
    assert choose_replica([2, 1, 1], [0, 0, 0], max_imbalance=10) == 1


def test_the_prefix_holder_wins_while_its_load_is_within_the_bound():
    assert choose_replica([4, 1], [100, 0], max_imbalance=3) == 0
    assert choose_replica([5, 1], [100, 0], max_imbalance=3) == 1     # past the bound


def test_longest_match_among_those_within_the_bound_then_load():
    assert choose_replica([0, 2, 9], [10, 30, 50], max_imbalance=2) == 1
    assert choose_replica([2, 1, 0], [30, 30, 0], max_imbalance=5) == 1


def test_ranking_falls_back_by_load():
    assert rank_replicas([4, 0, 2], [99, 0, 0], max_imbalance=5) == [0, 1, 2]
    assert rank_replicas([9, 0, 2], [99, 0, 0], max_imbalance=5) == [1, 2, 0]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="one load and one match"):
        choose_replica([1, 2], [0], max_imbalance=1)
    with pytest.raises(ValueError, match="max_imbalance"):
        choose_replica([1], [0], max_imbalance=-1)
