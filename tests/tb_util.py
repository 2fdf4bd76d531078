"""Reading TensorBoard event files back, and what a metrics stream says they must hold."""
from __future__ import annotations

from pathlib import Path

import pytest


def tb_scalars(directory) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in ``directory``: tag -> [(step, value)] in write order
    (by wall time: a stream's writers, one after another)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events: dict[str, list] = {}
    for path in Path(directory).glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            events.setdefault(tag, []).extend(acc.Scalars(tag))
    return {tag: [(e.step, e.value) for e in sorted(evs, key=lambda e: e.wall_time)]
            for tag, evs in events.items()}


def expected_scalars(records) -> dict[str, list[tuple[int, float]]]:
    """Each int/float field of each record as ``<event>/<field>`` at the record's step: its epoch
    (an epoch record), else its ``step`` field, else the count of its event's records before it."""
    seen: dict[str, int] = {}
    out: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        event = r["event"]
        if event == "epoch":
            step = r["epoch"]
        elif isinstance(r.get("step"), int):
            step = r["step"]
        else:
            step = seen.get(event, 0)
        seen[event] = seen.get(event, 0) + 1
        for key, value in r.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out.setdefault(f"{event}/{key}", []).append((step, value))
    return out


def assert_same(records, directory) -> dict[str, list[tuple[int, float]]]:
    """The event files in ``directory`` hold every number of ``records`` at its step (float32:
    TensorBoard's precision); returns what they hold."""
    got = tb_scalars(directory)
    want = expected_scalars(records)
    assert want, "no numbers in the stream"
    for tag, points in want.items():
        assert tag in got, f"{tag} missing from the event files ({sorted(got)[:20]} ...)"
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in points], rel=1e-6), tag
    return got
