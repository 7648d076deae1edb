"""The benches' calls of 1 MiB or more go round several connections, one call each in
turn, smaller ones stay on the first (bench/fastpath_sweep.py's _Turns says why)."""

from __future__ import annotations

from kvstore_bench.fastpath_sweep import TURNS_FROM, _Turns
from kvstore_bench.peers_bench import _reader


def test_turns_take_each_item_once_a_round():
    turns = _Turns(["a", "b", "c"])
    assert [turns.next() for _ in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]
    assert turns.items == ["a", "b", "c"]


def _readers(log: list[int], n: int):
    return [lambda out, i=i: log.append(i) for i in range(n)]


def test_a_large_value_is_read_over_each_connection_in_turn():
    log: list[int] = []
    read = _reader(_readers(log, 3), TURNS_FROM)
    for _ in range(6):
        read(memoryview(b""))
    assert log == [0, 1, 2, 0, 1, 2]


def test_a_smaller_value_stays_on_the_first_connection():
    log: list[int] = []
    read = _reader(_readers(log, 3), TURNS_FROM - 1)
    for _ in range(4):
        read(memoryview(b""))
    assert log == [0, 0, 0, 0]
