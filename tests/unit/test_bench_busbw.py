"""``hpcasync bench allreduce``'s bus bandwidth (nccl-tests: busbw = algbw·2(n−1)/n) and its
table's columns, without MPI."""
from __future__ import annotations

import pytest

from hpcasync.bench.allreduce import algbw, busbw, format_table, summary, table_head


def test_busbw_is_algbw_times_two_n_minus_one_over_n():
    assert algbw(1 << 30, 0.5) == pytest.approx(2 * (1 << 30) / 1e9)
    assert busbw(1 << 30, 0.5, 4) == pytest.approx(algbw(1 << 30, 0.5) * 1.5)      # 2·3/4
    assert busbw(10 ** 9, 1.0, 2) == pytest.approx(1.0)                            # 2·1/2
    assert busbw(10 ** 9, 1.0, 8) == pytest.approx(1.75)                           # 2·7/8
    assert busbw(10 ** 9, 1.0, 1) == 0.0                           # one rank moves nothing


ROW = {"bytes": 1 << 20, "iters": 5, "layout": "2×2", "ranks": 4, "memcpy": 1e-4,
       "mpi": 1e-3, "ours": 5e-4, "shm": 5e-4, "auto": "window"}


def test_table_head_names_the_busbw_columns_and_only_measured_methods():
    assert table_head([ROW]) == [
        "size", "iters", "cold copy GB/s", "bound µs", "MPI_Allreduce µs", "ours µs", "auto",
        "window µs", "ours/MPI", "window/MPI", "MPI of bound", "ours of bound",
        "MPI busbw GB/s", "ours busbw GB/s"]
    head = table_head([{**ROW, "persistent": 8e-4, "hier": 2e-3}])
    assert head[8:10] == ["persistent µs", "hier 2×2 µs"]
    assert head[10:14] == ["ours/MPI", "window/MPI", "persistent/MPI", "hier/MPI"]
    assert head[-3:] == ["MPI busbw GB/s", "ours busbw GB/s", "persistent busbw GB/s"]


def test_table_rows_carry_busbw_and_the_persistent_ratio():
    table = format_table([{**ROW, "persistent": 8e-4}])
    head, rule, row = table.splitlines()
    assert head.count("|") == rule.count("|") == row.count("|")
    cells = [c.strip() for c in row.strip("|").split("|")]
    # 1 MiB in 1 ms: algbw 1.05 GB/s, busbw 1.57; ours 0.5 ms: 3.15; persistent 0.8 ms: 1.97
    assert cells[-3:] == ["1.57", "3.15", "1.97"]
    assert cells[8] == "800.0" and cells[11] == "1.25"             # persistent µs, /MPI
    assert "persistent/MPI from 1.25 (1 MiB) to 1.25 (1 MiB)." in summary([{**ROW,
                                                                           "persistent": 8e-4}])
