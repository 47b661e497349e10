"""Adapters that give a framework's training loop ``elastic.State``'s snapshots.

Each lives in its own module and imports its framework there: ``import elastic`` never
imports one (they are optional extras: ``pip install -e '.[lightning]'``).

- ``elastic.integrations.lightning.ElasticLightning``: a Lightning ``Callback``.
"""
