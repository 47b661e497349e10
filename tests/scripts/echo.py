"""Print a line to stdout and one to stderr; with --fail-first, rank 1 fails the first attempt.

With ECHO_SYNC set (a path prefix), rank 0 marks that it printed and rank 1 waits for the
mark before failing, so rank 0's first line is never cut off by the restart: a test can
compare every line of both attempts.
"""

import os
import sys
import time
from pathlib import Path

rank = os.environ["RANK"]
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
sync = os.environ.get("ECHO_SYNC")
# one write per line (print() writes the newline apart): the ranks share the console
sys.stdout.write(f"hello from {rank}\n")
sys.stdout.flush()
sys.stderr.write(f"complaint from {rank}\n")
sys.stderr.flush()
if sync and rank == "0":
    Path(f"{sync}.{attempt}").touch()
if "--fail-first" in sys.argv and rank == "1" and attempt == "0":
    deadline = time.monotonic() + 30
    while sync and not Path(f"{sync}.{attempt}").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(3)
