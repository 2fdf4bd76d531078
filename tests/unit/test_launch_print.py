"""``python -m hpcasync.launch`` prints the MPI's name and the launcher command for shell scripts;
``scripts/setup.sh`` reads the first line through ``| head -n 1`` under ``set -o pipefail``.

With ``PYTHONUNBUFFERED=1`` ``print`` wrote the text and its newline in two writes, so ``head``
could exit between them: ``BrokenPipeError``, a non-zero pipeline and setup's "no usable MPI"
(8 of 30 tries here; a clean-clone CI run stopped on it)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_reader_that_takes_only_the_first_line_never_fails_the_pipeline():
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    cmd = f"set -o pipefail; {sys.executable} -m hpcasync.launch -n 1 | head -n 1"
    for _ in range(12):
        out = subprocess.run(["bash", "-c", cmd], env=env, cwd=REPO, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0 and "BrokenPipe" not in out.stderr, out.stderr
        assert out.stdout.strip(), out.stdout           # the MPI's name
