"""hpcasync.inject: what each variable does at which phase, counted per run, for one rank only.

The kills themselves are exercised by the reliability tests (tests/mpi/reliability): here the plan
(which rank, which phase, which count), the actions that leave the process alive (sleep, fail,
signal, fault, NaN) and the re-reading of the variables between in-process runs.
"""
from __future__ import annotations

import signal

import pytest
import torch

from hpcasync import inject
from hpcasync.errors import ConfigError, ProcessFailedError

VARS = (*inject._PLAN_ENV, inject.KILL_LOG_ENV)


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for v in VARS:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(inject, "_rank", lambda: 2)     # this process is rank 2
    inject.start_run()
    yield
    inject.start_run()


def test_nothing_set_is_a_no_op():
    for phase in inject.PHASES:
        inject.point(phase)
    assert inject._plan() == {}


def test_fail_fires_at_the_nth_time_of_its_phase_only(monkeypatch):
    monkeypatch.setenv(inject.KILL_AT_ENV, "2:epoch_end:3::fail,1:epoch_end:1::fail")
    inject.point("epoch_end")
    inject.point("step")                            # another phase: not counted
    inject.point("epoch_end")
    with pytest.raises(ProcessFailedError, match="epoch_end 3"):
        inject.point("epoch_end")
    inject.point("epoch_end")                       # once


def test_fire_false_counts_without_acting(monkeypatch):
    monkeypatch.setenv(inject.KILL_AT_ENV, "2:adopt:2::fail")
    inject.point("adopt", fire=False)
    with pytest.raises(ProcessFailedError):
        inject.point("adopt")


def test_counts_restart_with_a_run_and_the_variables_are_read_again(monkeypatch):
    monkeypatch.setenv(inject.KILL_AT_ENV, "2:final:2::fail")
    inject.point("final")
    inject.start_run()
    inject.point("final")                           # the first of the new run
    with pytest.raises(ProcessFailedError):
        inject.point("final")
    monkeypatch.setenv(inject.KILL_AT_ENV, "3:final:1::fail")     # another rank now
    inject.start_run()
    inject.point("final")


def test_the_last_item_for_a_rank_and_phase_counts(monkeypatch):
    monkeypatch.setenv(inject.KILL_AT_ENV, "2:step:1::fail,2:step:2::fail")
    inject.point("step")
    with pytest.raises(ProcessFailedError):
        inject.point("step")


def test_fault_raises_from_the_nth_step_on(monkeypatch):
    monkeypatch.setenv(inject.FAULT_ENV, "2:2")
    inject.point("step")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="injected fault"):
            inject.point("step")


def test_nan_poisons_the_named_step_only(monkeypatch):
    monkeypatch.setenv(inject.NAN_ENV, "2:5")
    g = torch.ones(4)
    inject.point("gradient", step=4, grad=g)
    assert torch.isfinite(g).all()
    inject.point("gradient", step=5, grad=g)
    assert torch.isnan(g[0]) and torch.isfinite(g[1:]).all()


def test_signal_at_the_nth_step_and_served(monkeypatch):
    got = []
    old = signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
    try:
        monkeypatch.setenv(inject.SIGNAL_ENV, "2:2")
        inject.point("step")
        assert got == []
        inject.point("step")
        assert got == [1]
        inject.point("served")
        inject.point("served")
        assert got == [1, 1]
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_kill_names_push_and_served_and_is_forgotten(monkeypatch):
    monkeypatch.setenv(inject.KILL_ENV, "2:3")
    plan = inject._plan()
    assert plan == {"push": [("kill", 3, 0.0, "")], "served": [("kill", 3, 0.0, "")]}
    inject.forget(inject.KILL_ENV)
    assert inject._plan() == {}


def test_a_replacement_drops_what_names_first_launch_ranks(monkeypatch):
    for v in (inject.KILL_AT_ENV, inject.KILL_ENV, inject.FAULT_ENV, inject.SIGNAL_ENV):
        monkeypatch.setenv(v, "2:1" if v != inject.KILL_AT_ENV else "2:step:1")
    inject.forget_first_launch()
    assert set(inject._plan()) == {"step", "served"}       # the signal only
    assert inject._plan()["step"][0][0] == "signal"


@pytest.mark.parametrize("item", ["2:nosuch:1", "x:step:1", "2:step:n", "2:step:1:w",
                                  "2:step:1:1:boom"])
def test_a_bad_item_is_a_one_line_config_error(monkeypatch, item):
    monkeypatch.setenv(inject.KILL_AT_ENV, item)
    with pytest.raises(ConfigError, match="RANK:PHASE:N"):
        inject.point("step")


def test_sleep_only_sleeps(monkeypatch):
    monkeypatch.setenv(inject.KILL_AT_ENV, "2:grow:1:0.01:sleep")
    inject.point("grow")                            # alive
