"""The arithmetic of a reset (:meth:`hpcasync.runtime.elastic.FaultTolerance.reset`) without MPI:
which survivor is the sync root, how far each one was behind it, and how many replacements a
grow spawns. The reset itself, on real ULFM jobs: tests/mpi/reliability (test_sync_failure's
adopt test, test_atomic_recovery, test_join, test_elastic_grow)."""
from __future__ import annotations

from hpcasync.runtime.elastic import FaultTolerance, Membership, _behind, furthest


def test_the_root_holds_the_largest_key_the_lowest_rank_among_equals():
    assert furthest([3, 5, 5, 1]) == 1                    # commits
    assert furthest([(1, 7, 1), (1, 8, 1), (2, 0, 1), (1, 8, 1)]) == 2   # epoch ends count first
    assert furthest([(1, 30, 1, 9)] * 3) == 0             # all alike: the lowest


def test_steps_behind_counts_batches_of_one_epoch_and_says_minus_one_across_an_epoch_end():
    assert [_behind(k, 5) for k in (5, 3, 0)] == [0, 2, 5]
    root = (2, 0, 1)
    assert [_behind(k, root) for k in ((1, 46, 1), (2, 0, 1))] == [-1, 0]
    assert _behind((1, 7, 1, 3), (1, 8, 1, 4)) == 1       # OD-SGD's rounds beside


class _World(Membership):
    def __init__(self, size: int, refill_only: bool = False):
        self.n, self.refill_only = size, refill_only

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return 0


def test_a_grow_spawns_up_to_max_ranks_or_only_into_the_emptied_places():
    ft = FaultTolerance(_World(4), ulfm=False, grow_back=True, max_ranks=6)
    ft.membership.n = 3                     # one death
    assert ft._want(4) == 3                 # up to max_ranks
    daso = FaultTolerance(_World(4, refill_only=True), ulfm=False, grow_back=True, max_ranks=6)
    daso.membership.n = 3
    assert daso._want(4) == 1               # back into the dead rank's place only
    assert ft.original == [0, 1, 2, 3] and ft.next_id == 4
