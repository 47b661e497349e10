"""Adapters that give a framework's training loop ``elastic.State``'s snapshots.

Each lives in its own module and imports its framework there: ``import elastic`` never
imports one (they are optional extras: ``pip install -e '.[lightning]'``).

- ``elastic.integrations.lightning.ElasticLightning``: a Lightning ``Callback``.
- ``elastic.integrations.transformers.ElasticCallback``: a Hugging Face ``TrainerCallback``
  that ``attach(trainer)`` adds, wrapping ``train()``.
- ``elastic.integrations.accelerate.ElasticLoader``: a loader ``accelerator.prepare``
  returned, its place in the epoch kept through ``elastic.State``.
"""

import elastic

elastic._uses_elastic()  # a fork server's child, which found elastic imported: said here
