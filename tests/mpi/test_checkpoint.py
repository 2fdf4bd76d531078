"""The agreed preemption stop: a signal on one rank, and every rank agrees to stop. (Checkpoint files
themselves, one process: tests/unit/test_checkpoint.py.)"""
import os
import signal
import time

from hpcasync.checkpoint import EXIT_PREEMPTED, PreemptionFlag
from tests.mpi_util import COMM, RANK, SIZE


def test_preemption_flag_from_signal_and_agree():
    assert EXIT_PREEMPTED == 75
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    with PreemptionFlag() as flag:
        assert not flag.requested
        assert flag.agree(COMM) is False
        if RANK == SIZE - 1:                       # one rank gets the warning
            os.kill(os.getpid(), signal.SIGUSR1)
            deadline = time.time() + 5
            while not flag.requested and time.time() < deadline:
                time.sleep(0.01)                  # the handler runs between bytecodes
            assert flag.signum == signal.SIGUSR1
        assert flag.requested == (RANK == SIZE - 1)
        assert flag.agree(COMM) is True           # every rank agrees to stop
        assert flag.requested
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)) == before
