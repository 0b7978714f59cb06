"""The training engine: :mod:`resolve` turns the settings into one resolved run (``--plan auto``
and the ``auto`` settings decided, with their reasons), :mod:`parts` holds the pieces that own
their state (model, optimizer, weight average, RNG, sampler position, progress),
:mod:`checkpointer` saves and restores them (``last.pt``, ``best.pt``, the mid-epoch recovery
write) in the format of :mod:`checkpoint`, :mod:`hooks` holds what runs at named points of the
loop (plan refit, preemption), and :mod:`trainer` builds the trainer from those parts
(:mod:`data` for the training data) and fits it.

The loop's pieces: :mod:`steps` (the optimizer, its schedule and one epoch of steps),
:mod:`validation` (exact sharded evaluation), :mod:`inference` (sliding windows),
:mod:`preemption` and :mod:`epoch_position` (signals, mid-epoch checkpoints and where an epoch
stands), :mod:`tracking` (metrics.jsonl, TensorBoard, progress), :mod:`ema` (the weight
average) and :mod:`preflight` (the checks of the run dir and data before anything starts).
"""
