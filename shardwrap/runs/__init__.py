"""Training runs: the Logbook that records a run and rolls it back past loss spikes
(``logbook.py``, ``spikes.py``), and reading a run back for summaries and plots (``runlog.py``).
Imports any package below it (``shardwrap.options`` up to ``checkpoint`` and ``planning``); never
``integrations``.
"""
