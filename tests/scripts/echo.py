"""Print a line to stdout and one to stderr; with --fail-first, rank 1 fails the first attempt."""

import os
import sys

rank = os.environ["RANK"]
# one write per line (print() writes the newline apart): the ranks share the console
sys.stdout.write(f"hello from {rank}\n")
sys.stdout.flush()
sys.stderr.write(f"complaint from {rank}\n")
sys.stderr.flush()
if "--fail-first" in sys.argv and rank == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.exit(3)
