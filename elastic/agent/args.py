"""The command line: every torchrun 2.13 flag (both spellings, ``PET_*`` variables) plus ours.

Parsing only; ``config.build_config`` turns the namespace into a checked ``RunConfig``.
Errors are raised as ``UsageError`` (one line naming the problem, with the usage line and
the closest flag for a typo), never printed here, so the CLI decides how to report them.
Flags may be abbreviated, as torchrun's argparse allows (``--redirect=3``).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
from collections.abc import Sequence
from typing import Any, NoReturn

USAGE = "elastic-run [options] training_script [training_script_args ...]"


class UsageError(ValueError):
    """Bad command-line input; the message names the flag and the problem. ``code`` is
    the exit code torchrun gives the same mistake: 2 for what argparse refuses (a flag
    it does not know, a missing script), 1 for a value its launcher refuses."""

    def __init__(self, message: str, usage: str = "", code: int = 1) -> None:
        super().__init__(message)
        self.usage = usage
        self.code = code


class Parser(argparse.ArgumentParser):
    """argparse, with errors raised as UsageError (and a suggestion for a mistyped flag)."""

    def error(self, message: str) -> NoReturn:
        unknown = re.match(r"unrecognized arguments: (--?[\w-]+)", message)
        if unknown:
            flags = [o for a in self._actions for o in a.option_strings if "_" not in o]
            close = closest(unknown[1].split("=")[0], flags)
            if close:
                message += f" (did you mean {close}?)"
        if "arguments are required: training_script" in message:
            message = (
                "no training script given: elastic-run [options] train.py [its arguments] "
                "(elastic-run --help lists the options; 'elastic-run status' shows a job)"
            )
        raise UsageError(message, usage=f"usage: {USAGE}", code=2)


def closest(word: str, choices: list[str]) -> str | None:
    """The choice ``word`` most likely misspells: the longest shared start first (--nprocs
    is --nproc-per-node, not --nnodes), then difflib's likeness."""

    def shared(a: str, b: str) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    likely = difflib.get_close_matches(word, choices, n=5, cutoff=0.5)
    prefixed = [c for c in choices if shared(word, c) >= max(len(word) - 2, 4)]
    ranked = sorted(
        set(likely) | set(prefixed),
        key=lambda c: (-shared(word, c), -difflib.SequenceMatcher(None, word, c).ratio()),
    )
    return ranked[0] if ranked else None


class HelpFormatter(argparse.HelpFormatter):
    """torchrun's users know the dashed spellings: the underscore aliases stay accepted
    but out of the listing; defaults are shown where there is one worth showing."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34, width=100)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if action.option_strings:
            shown = [o for o in action.option_strings if "_" not in o] or action.option_strings
            action = argparse.Action(shown, action.dest, nargs=action.nargs, metavar=action.metavar)
        return super()._format_action_invocation(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and not (default is None or default is False or default == "")
            and default is not argparse.SUPPRESS
            and "(default" not in text
        ):
            text += " (default: %(default)s)"
        return text


def _flag_names(name: str) -> list[str]:
    """torchrun accepts both --nproc-per-node and --nproc_per_node."""
    dashed = "--" + name.replace("_", "-")
    underscored = "--" + name
    return [dashed] if dashed == underscored else [dashed, underscored]


class EnvDefault(argparse.Action):
    """A value flag whose default comes from ``PET_<DEST>`` (torchrun's ``env`` action)."""

    def __init__(self, dest: str, default: object = None, **kwargs: Any) -> None:
        default = os.environ.get(f"PET_{dest.upper()}", default)
        super().__init__(dest=dest, default=default, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)


class EnvFlag(argparse.Action):
    """A switch that ``PET_<DEST>=1`` also turns on (torchrun's ``check_env`` action)."""

    def __init__(self, dest: str, default: bool = False, **kwargs: Any) -> None:
        raw = os.environ.get(f"PET_{dest.upper()}", "1" if default else "0")
        try:
            value = bool(int(raw))
        except ValueError:
            raise UsageError(f"PET_{dest.upper()}={raw!r}: expected 0 or 1") from None
        super().__init__(dest=dest, const=True, default=value, nargs=0, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, True)


def _value(
    p: argparse._ActionsContainer,
    name: str,
    default: object,
    help: str,
    short: str | None = None,
    **kw: Any,
) -> None:
    names = ([short] if short else []) + _flag_names(name)
    p.add_argument(*names, action=EnvDefault, dest=name, default=default, help=help, **kw)


def _switch(p: argparse._ActionsContainer, name: str, help: str, short: str | None = None) -> None:
    names = ([short] if short else []) + _flag_names(name)
    p.add_argument(*names, action=EnvFlag, dest=name, help=help)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="elastic-run",
        usage=USAGE,
        description="Elastic, fault-tolerant PyTorch launcher: torchrun's flags, agents that "
        "meet in etcd v3. Other commands: 'elastic-run status' (a job's state), "
        "'elastic-run tune-workers' (DataLoader num_workers).",
        epilog="Every flag also reads PET_<NAME> from the environment, as torchrun does "
        "(e.g. PET_NNODES=1:4); underscore spellings (--nproc_per_node) are accepted too.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    size = p.add_argument_group("job size")
    _value(size, "nnodes", "1:1", "number of nodes: N, or MIN:MAX for an elastic job")
    _value(
        size,
        "nproc_per_node",
        None,
        "workers per node: N, auto, cpu, gpu or xpu (default: 1; with --devices, one per device)",
    )
    _value(
        size,
        "devices",
        None,
        "GPUs this job may use (indices or UUIDs, like 0,2): workers see only these, local "
        "rank i on the i-th; two jobs share a machine this way",
    )
    _value(size, "node_id", None, "this node's id in the job (default: HOSTNAME-PID)")

    rdzv = p.add_argument_group("rendezvous")
    _value(
        rdzv,
        "rdzv_endpoint",
        "",
        "etcd host[:port][,host[:port]...]; if it names this host and nothing answers "
        "there, this agent serves an embedded etcd on it (default: an embedded etcd for "
        "this node alone, or for the static form below)",
    )
    _value(rdzv, "rdzv_id", "none", "job id shared by all nodes of a job")
    _value(rdzv, "rdzv_conf", "", "key=value,... (see docs/reference.md: rendezvous options)")
    _value(
        rdzv,
        "rdzv_backend",
        "etcd-v3",
        "etcd-v3 (also accepted: etcd, and torchrun's c10d and static, which mean the same here)",
    )
    _switch(rdzv, "standalone", "one node, an embedded etcd and a random job id")
    _value(
        rdzv,
        "node_rank",
        0,
        "static form (torchrun's default): this node's rank; with --nnodes N>1 and no "
        "--rdzv-endpoint, node 0 serves the job's etcd at --master-addr",
        type=int,
    )
    _value(rdzv, "master_addr", "127.0.0.1", "static form: the address of node 0")
    _value(
        rdzv,
        "master_port",
        None,
        "MASTER_PORT of the workers (rank 0's node hosts the store there; default: a "
        "fresh port each round); static form: node 0's etcd listens on MASTER_PORT+1",
        type=int,
    )
    _value(rdzv, "local_addr", None, "address other nodes reach this one at (default: FQDN)")

    work = p.add_argument_group("workers")
    _switch(work, "module", "run the script as 'python -m'", short="-m")
    _switch(work, "no_python", "run the script as a program, not with python")
    _switch(work, "run_path", "run the script with runpy.run_path in the worker interpreter")
    _value(
        work,
        "start_method",
        "spawn",
        "spawn: each worker a fresh python; forkserver (or fork): forked from a process "
        "that imported torch once, for fast restarts",
        choices=["spawn", "fork", "forkserver"],
    )
    _value(work, "role", "default", "worker role name (ROLE_NAME)")
    _switch(work, "virtual_local_rank", "each worker sees only its GPU, as device 0")
    _value(work, "monitor_interval", 0.1, "seconds between worker polls", type=float)
    _value(
        work,
        "signals_to_handle",
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "signals forwarded to the workers before this node leaves",
    )
    _value(
        work,
        "shutdown_timeout",
        None,
        "seconds from SIGTERM to SIGKILL of the workers (default: 30)",
        type=float,
    )

    ft = p.add_argument_group("fault tolerance")
    _value(
        ft,
        "max_restarts",
        0,
        "worker failures the whole job may restart from (not per node); "
        "membership changes are free",
        type=int,
    )
    _value(
        ft,
        "restart_mode",
        "live",
        "live: workers in State.run keep their process through membership changes and form "
        "the new process group in place; respawn: new workers every time (other scripts "
        "always get new workers)",
        choices=["live", "respawn"],
    )
    _value(
        ft,
        "handover_timeout",
        30.0,
        "seconds a node told to leave, while it alone holds the job's newest state in "
        "memory, trains on to hand it to a node registered to join (0: leave at once; "
        "a second signal leaves at once)",
        type=float,
    )
    _value(
        ft,
        "worker_hang_timeout",
        0.0,
        "a worker that reported progress (State.commit, elastic.heartbeat) and then none "
        "for this many seconds has failed (0: off)",
        type=float,
    )

    ckpt = p.add_argument_group("checkpoints (elastic.State)")
    _value(
        ckpt,
        "checkpoint_dir",
        None,
        "where durable checkpoints go (shared or per node); none: shared-memory snapshots only",
    )
    _value(
        ckpt,
        "snapshot_every",
        "auto",
        "snapshot every N steps (0: only to resize); auto: as often as --snapshot-budget allows",
    )
    _value(
        ckpt,
        "snapshot_budget",
        0.02,
        "with --snapshot-every auto, the share of step time snapshots may cost (0.02: 2%%)",
    )
    _value(
        ckpt, "checkpoint_every", 100, "every N-th snapshot also goes to --checkpoint-dir", type=int
    )
    _value(ckpt, "checkpoint_keep", 3, "checkpoints kept in --checkpoint-dir", type=int)

    met = p.add_argument_group("metrics")
    _value(
        met,
        "metrics_addr",
        "127.0.0.1",
        "address of /metrics and /healthz: this host only by default; 0.0.0.0 for a "
        "Prometheus elsewhere (the Kubernetes manifests set it)",
    )
    _value(
        met,
        "metrics_port",
        None,
        "port of /metrics and /healthz: N, 0 for any free one, -1 for none (default: 9400, "
        "or any free one if another agent has it)",
        type=int,
    )

    logs = p.add_argument_group("logging (as torchrun)")
    _value(logs, "log_dir", None, "base directory for per-attempt, per-rank logs")
    _value(
        logs, "redirects", "0", "send stdout/stderr to files: 0-3, or per rank 0:1,1:2", short="-r"
    )
    _value(
        logs, "tee", "0", "stdout/stderr to console and files, prefixed; same syntax", short="-t"
    )
    _value(logs, "local_ranks_filter", "", "only these local ranks print to the console")
    _value(logs, "duplicate_stdout_filters", "", "copy stdout lines containing these to a file")
    _value(logs, "duplicate_stderr_filters", "", "copy stderr lines containing these to a file")

    noop = p.add_argument_group("accepted for torchrun compatibility, no effect")
    _value(noop, "event_log_handler", "null", "torchrun's event log handler")
    _value(noop, "logs_specs", None, "torchrun's LogsSpecs plugin")
    _value(
        noop,
        "numa_binding",
        None,
        "torchrun's NUMA binding",
        choices=["node", "socket", "exclusive", "core-complex"],
    )

    p.add_argument("training_script", help="the training script (or module, or program)")
    p.add_argument(
        "training_script_args",
        nargs=argparse.REMAINDER,
        help="arguments for the training script, passed on as they are",
    )
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("elastic-run")
    except PackageNotFoundError:
        return "(not installed)"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse the launcher's flags; everything after the training script is the script's,
    never read as ours (argparse alone would take ``train.py --checkpoint x`` for an
    abbreviation of ``--checkpoint-dir``)."""
    parser = build_parser()
    head, tail = split_at_script(parser, list(argv))
    ns = parser.parse_args(head)
    ns.training_script_args = [*ns.training_script_args, *tail]
    return ns


def split_at_script(
    parser: argparse.ArgumentParser, argv: list[str]
) -> tuple[list[str], list[str]]:
    """(the launcher's flags and the script, the script's arguments). A flag that takes a
    value consumes the next word unless written ``--flag=value``; abbreviations count as
    argparse resolves them; the first other word not starting with '-' is the script."""
    takes_value = {o: a.nargs != 0 for a in parser._actions for o in a.option_strings}
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return argv[: i + 2], argv[i + 2 :]
        if not word.startswith("-") or word == "-":
            return argv[: i + 1], argv[i + 1 :]
        name, eq, _ = word.partition("=")
        exact = [name] if name in takes_value else []
        matches = exact or [o for o in takes_value if o.startswith(name) and name.startswith("--")]
        i += 2 if not eq and matches and all(takes_value[o] for o in matches) else 1
    return argv, []
