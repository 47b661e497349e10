"""etcd v3 rendezvous for elastic PyTorch jobs, usable by elastic-run and by stock torchrun."""

import os

# Before anything here loads gRPC: agents fork+exec workers, which needs no gRPC fork
# handlers, and gRPC's own INFO logging would interleave with the job's output.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def version() -> str:
    """The installed elastic-run's version ("dev" when run from a source tree)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("elastic-run")
    except PackageNotFoundError:
        return "dev"
