"""``python -m hpcasync``: the same entry point as the ``hpcasync`` console script."""
from hpcasync.cli import run_and_exit

if __name__ == "__main__":
    run_and_exit()          # main(), then the exit without the interpreter's teardown
