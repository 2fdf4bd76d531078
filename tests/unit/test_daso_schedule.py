"""DASO's pure pieces: the per-batch plan (written-out traces), phases, knob transitions, plateau
detection, the merge formula and the emulated link's arithmetic. No MPI."""
import math

import pytest
import torch

from hpcasync.daso import (DasoSchedule, Knobs, LinkDelay, PlateauDetector, merge, merge_,
                           merge_weights, next_knobs, phase_of, plan_batch)
from hpcasync.errors import ConfigError


def trace(knobs, n, phase="cycling", groups=2):
    """One token per batch: grad sync (g global, l local, - none), receiving group (or -),
    sending group (or -), average (n none, b buffers, a all)."""
    out = []
    for b in range(n):
        p = plan_batch(b, nbatches=n, phase=phase, knobs=Knobs(*knobs), num_groups=groups)
        sync = {"global": "g", "local": "l", "none": "-"}[p.grad_sync]
        recv = "-" if p.receive_group is None else str(p.receive_group)
        send = "-" if p.send_group is None else str(p.send_group)
        out.append(f"{sync}{recv}{send}{p.average[0]}")
    return out


def test_trace_4_1_1():
    # send every 4th batch (groups alternate), merge 1 batch later, local sync every batch;
    # batch 8 still sends (its merge at 9 is before the last batch 11), the last batch averages
    assert trace((4, 1, 1), 12) == ["l-0n", "l0-n", "l--n", "l--n", "l-1n", "l1-n", "l--n", "l--n",
                                    "l-0n", "l0-n", "l--n", "l--a"]


def test_trace_4_1_1_skips_a_send_that_would_land_on_the_last_batch():
    # n = 10: batch 8 would merge at 9 = the last batch, whose blocking average supersedes it
    assert trace((4, 1, 1), 10) == ["l-0n", "l0-n", "l--n", "l--n", "l-1n", "l1-n", "l--n", "l--n",
                                    "l--n", "l--a"]


def test_trace_8_2_2():
    # local sync on even batches only; sends at 0, 8, 16 (16 + 2 <= 18), merges 2 batches later
    expect = ["l-0n", "---n", "l0-n", "---n", "l--n", "---n", "l--n", "---n",
              "l-1n", "---n", "l1-n", "---n", "l--n", "---n", "l--n", "---n",
              "l-0n", "---n", "l0-n", "---a"]
    assert trace((8, 2, 2), 20) == expect


def test_trace_1_1_1():
    # a send every batch by alternating groups; each batch first merges the previous one
    assert trace((1, 1, 1), 6) == ["l-0n", "l01n", "l10n", "l01n", "l1-n", "l--a"]


def test_trace_1_1_1_one_group_per_node():
    assert trace((1, 1, 1), 4, groups=1) == ["l-0n", "l00n", "l0-n", "l--a"]


@pytest.mark.parametrize("phase", ["warmup", "cooldown"])
def test_trace_blocking(phase):
    # every batch averages gradients over all ranks; the last averages the buffers too
    assert trace((4, 1, 1), 4, phase=phase) == ["g--n", "g--n", "g--n", "g--b"]


def test_single_batch_epoch():
    assert trace((4, 1, 1), 1) == ["l--a"]
    assert trace((4, 1, 1), 1, phase="warmup") == ["g--b"]


def test_phases_and_warmup_zero_leaves_blocking_mode():
    ph = [phase_of(e, total_epochs=6, warmup_epochs=2, cooldown_epochs=1) for e in range(1, 7)]
    assert ph == ["warmup", "warmup", "cycling", "cycling", "cycling", "cooldown"]
    assert phase_of(1, total_epochs=3, warmup_epochs=0, cooldown_epochs=0) == "cycling"
    sched = DasoSchedule(total_epochs=3, num_groups=2, warmup_epochs=0, cooldown_epochs=0)
    assert sched.phase == "cycling" and sched.advance(5).send_group == 0


def test_batch_count_is_a_count():
    sched = DasoSchedule(total_epochs=2, num_groups=2, warmup_epochs=0, cooldown_epochs=0)
    plans = [sched.advance(5) for _ in range(5)]
    assert [p.batch for p in plans] == [0, 1, 2, 3, 4] and plans[-1].average == "all"
    assert [p.average for p in plans[:-1]] == ["none"] * 4
    with pytest.raises(ConfigError, match=r"epoch_end\(loss\)"):
        sched.advance(5)                    # a sixth batch in a 5-batch epoch
    rec = sched.end_epoch(1.0)
    assert rec["daso_phase"] == "cycling" and sched.epoch == 2
    sched.advance(5)
    with pytest.raises(ConfigError, match="1 of 5"):
        sched.end_epoch(1.0)                # ended early


def test_knob_transitions():
    k = Knobs(4, 1, 1)
    seen = [k]
    for _ in range(5):
        k = next_knobs(k, max_global_skips=8)
        seen.append(k)
    assert seen == [(4, 1, 1), (2, 1, 1), (1, 1, 1), (8, 2, 2), (4, 1, 1), (2, 1, 1)]
    assert next_knobs(Knobs(1, 1, 1), max_global_skips=16) == (16, 4, 4)
    assert next_knobs(Knobs(1, 1, 1), max_global_skips=2) == (2, 1, 1)
    assert next_knobs(Knobs(1, 2, 3), max_global_skips=8) == (1, 1, 2)


def test_plateau_detector():
    det = PlateauDetector(patience=3, threshold=0.05)
    # 1.0 improves (first); 0.96 is < 5 % better: bad 1; 0.94: 6 % better: improves;
    # then three epochs without 5 % gain -> plateau on the third; the count restarts
    out = [det.update(x) for x in (1.0, 0.96, 0.94, 0.93, 0.92, 0.91, 0.90, 0.90, 0.90)]
    assert out == [False, False, False, False, False, True, False, False, True]
    with pytest.raises(ConfigError):
        PlateauDetector(patience=0)
    with pytest.raises(ConfigError):
        PlateauDetector(threshold=1.0)
    with pytest.raises(ValueError, match="diverged"):
        det.update(math.nan)


def run_schedule(sched, losses, n=4):
    """Drive ``sched`` through len(losses) epochs; returns the epoch records."""
    records = []
    for loss in losses:
        for _ in range(n):
            sched.advance(n)
        records.append(sched.end_epoch(loss))
    return records


def test_schedule_adapts_on_plateau_in_cycling_epochs_only():
    sched = DasoSchedule(total_epochs=12, num_groups=2, warmup_epochs=1, cooldown_epochs=1)
    recs = run_schedule(sched, [5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    knobs = [(r["daso_phase"], r["daso_global_skip"], r["daso_local_skip"],
              r["daso_batches_to_wait"]) for r in recs]
    # epoch 2 sets the best loss; plateaus end epochs 5 and 8 and 11 -> knobs change after them
    assert knobs == [("warmup", 1, 1, 0)] + [("cycling", 4, 1, 1)] * 4 + \
        [("cycling", 2, 1, 1)] * 3 + [("cycling", 1, 1, 1)] * 3 + [("cooldown", 1, 1, 0)]
    assert [r["daso_plateau"] for r in recs].count(True) == 3
    assert sched.knobs == (8, 2, 2)


def test_schedule_state_dict_round_trip():
    sched = DasoSchedule(total_epochs=8, num_groups=2, warmup_epochs=0, cooldown_epochs=0,
                         plateau_patience=1)
    run_schedule(sched, [1.0, 1.0])
    copy = DasoSchedule(total_epochs=8, num_groups=2, warmup_epochs=0, cooldown_epochs=0,
                        plateau_patience=1)
    copy.load_state_dict(sched.state_dict())
    assert (copy.epoch, copy.knobs, copy.plateau.best) == (3, (2, 1, 1), 1.0)
    sched.advance(4)                        # mid-epoch: the batch and its count travel too
    mid = DasoSchedule(total_epochs=8, num_groups=2, warmup_epochs=0, cooldown_epochs=0,
                       plateau_patience=1)
    mid.load_state_dict(sched.state_dict())
    assert (mid.epoch, mid.batch, mid.nbatches) == (3, 1, 4)
    assert mid.advance(4) == sched.advance(4)


@pytest.mark.parametrize("kwargs, match", [
    ({"global_skip": 16}, "exceeds max_global_skips"),
    ({"warmup_epochs": -1}, "warmup_epochs"),
    ({"batches_to_wait": 0}, "batches_to_wait"),
    ({"local_skip": 1.5}, "local_skip"),
    ({"total_epochs": 0}, "total_epochs"),
])
def test_schedule_rejects_bad_knobs(kwargs, match):
    args = {"total_epochs": 4, "num_groups": 2, **kwargs}
    with pytest.raises(ConfigError, match=match):
        DasoSchedule(**args)


def test_degenerate_when_blocking_epochs_cover_the_run():
    assert DasoSchedule(total_epochs=8, num_groups=2).degenerate
    assert not DasoSchedule(total_epochs=9, num_groups=2).degenerate


def test_merge_formula_on_known_inputs():
    local = torch.tensor([1.0, 2.0, -4.0])
    total = torch.tensor([4.0, 6.0, 0.0])          # S over P = 2 nodes, own stale copy included
    # B = 1: (2·x + S) / 4
    assert torch.equal(merge(local, total, batches_to_wait=1, num_nodes=2),
                       torch.tensor([1.5, 2.5, -2.0]))
    # B = 2, P = 4: (4·x + S) / 8
    assert torch.equal(merge(local, total, batches_to_wait=2, num_nodes=4),
                       torch.tensor([1.0, 1.75, -2.0]))
    assert merge_weights(batches_to_wait=3, num_nodes=2) == (0.75, 0.125)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    s = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    ref = merge(x, s, batches_to_wait=2, num_nodes=3)
    torch.testing.assert_close(merge_(x.clone(), s, batches_to_wait=2, num_nodes=3), ref)
    with pytest.raises(ConfigError):
        merge(local, total, batches_to_wait=0, num_nodes=2)
    with pytest.raises(ConfigError, match="shape"):
        merge(local, total[:2], batches_to_wait=1, num_nodes=2)


def test_merge_of_identical_copies_is_identity():
    # P nodes all at x, no progress since: (2B·x + P·x) / (2B + P) = x
    x = torch.tensor([0.5, -3.0, 7.25])
    assert torch.equal(merge(x, 2 * x, batches_to_wait=1, num_nodes=2), x)


def test_link_delay_arithmetic():
    d = LinkDelay(1000.0)                  # 1000 µs per 10^6 bytes = 1 GB/s
    assert d.seconds(2_000_000) == pytest.approx(2e-3)
    assert LinkDelay(0).seconds(10**9) == 0
    import time
    t0 = time.perf_counter()
    d.until_ready(t0 - 1.0, 2_000_000)     # arrived long ago: no sleep
    assert time.perf_counter() - t0 < 0.05
    with pytest.raises(ConfigError):
        LinkDelay(-1)


def test_an_epoch_end_redone_from_the_state_before_it_counts_the_epoch_once():
    """What the DASO loop sends for a position at an epoch end after a death there (the
    schedule before ``end_epoch``, docs/design/recovery.md): closing the epoch again from it
    gives an undisturbed run's record and counters; closing the closed schedule again (the bug)
    counts the epoch twice."""
    def closed(sched, n=5, loss=1.0):
        for _ in range(n):
            sched.advance(n)
        return sched.end_epoch(loss)

    once = DasoSchedule(total_epochs=3, num_groups=2, warmup_epochs=0, cooldown_epochs=1)
    redo = DasoSchedule(total_epochs=3, num_groups=2, warmup_epochs=0, cooldown_epochs=1)
    want = closed(once)
    for _ in range(5):
        redo.advance(5)
    before = {"epoch": redo.epoch, "batch": redo.batch, "knobs": list(redo.knobs),
              "plateau": dict(redo.plateau.state_dict())}
    redo.end_epoch(1.0)                       # the adopter had closed it, then the death
    redo.epoch, redo.batch, redo.nbatches = before["epoch"], before["batch"], 5
    redo.knobs = Knobs(*before["knobs"])
    redo.plateau.load_state_dict(before["plateau"])
    assert redo.end_epoch(1.0) == want and (want["daso_epoch"], want["daso_batches"]) == (1, 5)
    assert (redo.epoch, redo.phase, redo.knobs) == (once.epoch, once.phase, once.knobs) == \
        (2, "cycling", Knobs(4, 1, 1))
    twice = DasoSchedule(total_epochs=3, num_groups=2, warmup_epochs=0, cooldown_epochs=1)
    closed(twice)
    twice.batch, twice.nbatches = 5, 5
    assert twice.end_epoch(1.0)["daso_epoch"] == 2 and twice.phase == "cooldown"


def test_recount_after_a_change_of_world_moves_the_last_batch():
    """An elastic reset deals the rest of an epoch over another number of ranks: after 3 of 6
    batches the epoch is recounted as 7; the closing average moves to batch 6, no send starts
    whose merge would land on it, and the epoch closes after 7 batches."""
    sch = DasoSchedule(total_epochs=2, num_groups=2, warmup_epochs=0, cooldown_epochs=1,
                       global_skip=1)
    plans = [sch.advance(6) for _ in range(3)]
    assert [p.average for p in plans] == ["none"] * 3
    sch.recount(7)
    plans = [sch.advance(7) for _ in range(4)]
    assert [p.average for p in plans] == ["none", "none", "none", "all"]
    assert [p.send_group is not None for p in plans] == [True, True, False, False]
    assert sch.end_epoch(1.0)["daso_batches"] == 7
    with pytest.raises(ConfigError, match="batch count must stay fixed"):
        sch.advance(6), sch.advance(5)          # without a recount the count is fixed
    sch2 = DasoSchedule(total_epochs=2, num_groups=2, warmup_epochs=0, cooldown_epochs=1)
    for _ in range(3):
        sch2.advance(6)
    with pytest.raises(ConfigError, match="3 batches are done"):
        sch2.recount(2)
    sch3 = DasoSchedule(total_epochs=2, num_groups=2)
    sch3.recount(9)                             # not begun: the first advance counts it
    assert sch3.nbatches is None
