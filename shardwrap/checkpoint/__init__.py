"""Saving and loading: sharded checkpoints (``save.py``, ``load.py``), consolidated safetensors
exports (``export.py``) and loading them, or a Hugging Face folder, back (``pretrained.py``),
the file machinery they share (``files.py``:
streamed safetensors, atomic folders, agreement across ranks, the names of shardwrap's files in a
folder) and content checksums (``checksum.py``); the optimizer's state as over the unwrapped
model, for one-file checkpoints (``full_optimizer.py``). Imports ``shardwrap.options``, ``comm``,
``tiers`` and ``engine``; never ``planning``, ``runs`` or ``integrations``.
"""
