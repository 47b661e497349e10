"""A worker group started as the agent starts one, for tests of what the agent sees of it."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from elastic.agent.logs import LogRouter
from elastic.agent.placement import Placement
from elastic.agent.workers import WorkerGroup


@contextlib.contextmanager
def started(
    tmp_path: Path, code: str, placements: list[Placement], env: dict[str, str] | None = None
) -> Iterator[WorkerGroup]:
    """Workers running ``code`` at ``placements``, as the agent starts them; stopped, and
    their logs closed, at the end."""
    script = tmp_path / "worker.py"
    script.write_text(code)
    router = LogRouter(str(tmp_path / "logs"), "job", "a", {}, {}, None)
    group = WorkerGroup((sys.executable, str(script)), router, tmp_path, role="default",
                        run_id="job", max_restarts=0, extra_env=env)  # fmt: skip
    group.start(placements)
    try:
        yield group
    finally:
        group.stop(0)
        router.close(lambda *_: None)
