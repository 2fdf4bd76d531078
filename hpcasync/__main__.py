"""``python -m hpcasync``: the same entry point as the ``hpcasync`` console script."""
from hpcasync.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
