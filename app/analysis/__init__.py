"""After training: prediction (``predict``), evaluation (``evaluate``), grains and their size
distribution (``grains``), the run report (``report``), the classical floor (``floor``) and the
learned floor (``learned_floor``); the command-line pieces (``cli``), figures (``figures``) and
mask clean-up (``masks``) they share live in one module each, so that no command imports another
for a helper. The commands are run as ``python -m app.predict`` (and so on): thin entry points at
the top of ``app``."""
