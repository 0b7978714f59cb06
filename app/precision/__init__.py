"""Mixed precision: native ``torch.amp`` and legacy apex behind one interface (``amp``), the fp32
op registry (``ops``), and ``auto``: capability rules (``hardware``), the kernel check
(``kernel_check``) and the measured probe with its cache (``auto``).

This ``__init__`` imports nothing: ``ops`` is used by the label scheme, which the configuration
imports, and ``amp`` imports the configuration.
"""
