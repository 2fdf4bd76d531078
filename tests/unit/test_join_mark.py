"""One way to tell a replacement (runtime.join.is_joiner): the spawn's environment mark with
Open MPI's parent port, for the CLI and the elastic loops alike; no command-line flag."""
from __future__ import annotations

import pytest

from hpcasync.runtime import join


@pytest.mark.parametrize("mark, port, expected", [("1", "x", True), ("wait", "x", True),
                                                   ("1", None, False), (None, "x", False),
                                                   ("0", "x", False)])
def test_is_joiner_reads_the_spawns_mark(monkeypatch, mark, port, expected):
    monkeypatch.setattr(join, "_joined", {})
    for name, value in ((join.JOINER_ENV, mark), (join.PARENT_ENV, port)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert join.is_joiner() is expected


def test_the_cli_has_no_joiner_option():
    from hpcasync.cli import build_parser

    help_text = build_parser().format_help()
    assert "joiner" not in help_text
    from hpcasync.errors import ConfigError

    with pytest.raises(ConfigError, match="unrecognized arguments: --grow-joiner"):
        build_parser().parse_args(["train", "--grow-joiner"])
