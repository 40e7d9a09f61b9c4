"""Checkpoints and export: saving, loading, validation, checksums and full disks."""
