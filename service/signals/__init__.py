"""Signal processors: Q/K spectra, expert health, pathways, intrinsic dimension.

Importing this package registers nothing.  Each module registers its
processors (with the documented default configuration) when it is imported:

- :mod:`taproute.service.signals.qk` -- ``signals.qk_spectra`` (stateless, per
  record and head) and ``signals.qk_summary`` (stateful, per hook and head over
  a window);
- :mod:`taproute.service.signals.experts` -- ``signals.expert_health``;
- :mod:`taproute.service.signals.pathways` -- ``signals.pathways``;
- :mod:`taproute.service.signals.twonn` -- ``signals.intrinsic_dimension``.

Each module also has a ``register(config)`` for other shapes (head counts,
expert counts, windows) under other names.  :mod:`taproute.service.signals.taps`
binds the PyTorch hooks that produce their inputs.
"""
