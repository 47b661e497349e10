"""Print a line to stdout and one to stderr; with --fail-first, rank 1 fails the first attempt."""

import os
import sys

rank = os.environ["RANK"]
print(f"hello from {rank}", flush=True)
print(f"complaint from {rank}", file=sys.stderr, flush=True)
if "--fail-first" in sys.argv and rank == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.exit(3)
