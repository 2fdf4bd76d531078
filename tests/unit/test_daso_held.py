"""DASO's merge leaves held ranges bitwise alone; held_ranges joins adjacent parameters."""
import torch

from hpcasync.daso.merge import held_ranges, merge_


def test_held_ranges_join_adjacent_and_skip_empty():
    assert held_ranges([0, 4, 10, 12, 20], [4, 6, 2, 8, 0], [True, True, False, True, True]) \
        == [(0, 10), (12, 20)]
    assert held_ranges([0, 3], [3, 3], [False, False]) == []


def test_merge_keeps_held_ranges_bitwise_even_through_bf16():
    x = torch.randn(12)
    before = x.clone()
    total = (2 * x).to(torch.bfloat16).float()          # two replicas that agree, sent in bf16
    merge_(x, total, batches_to_wait=1, num_nodes=2, keep=[(0, 5), (9, 12)])
    assert torch.equal(x[:5], before[:5]) and torch.equal(x[9:], before[9:])
    assert not torch.equal(x[5:9], before[5:9])           # the rest is merged (and rounded)
