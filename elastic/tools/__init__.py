"""Subcommands besides running a job: ``elastic-run status`` and ``elastic-run tune-workers``."""
