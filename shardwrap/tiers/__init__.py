"""Offload tiers: where a flat group's shard lives between uses, on the compute device, in pinned
host memory or in files on disk (``home.py``), and what the optimizer meets of them: the disk
tier's shard parameters and the step pre-hook that prefers the fused kernels (``offload.py``).
Imports only ``shardwrap.options`` and ``shardwrap.comm``.
"""
