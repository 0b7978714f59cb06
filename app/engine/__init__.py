"""The training engine: :mod:`resolve` turns the settings into one resolved run (``--plan auto``
and the ``auto`` settings decided, with their reasons), :mod:`parts` holds the pieces that own
their state (model, optimizer, weight average, RNG, progress), :mod:`checkpointer` saves and
restores them (``last.pt``, ``best.pt``, the mid-epoch recovery write), :mod:`hooks` holds what
runs at named points of the loop (plan refit, preemption), and :mod:`trainer` builds the trainer
from those parts and fits it.
"""
