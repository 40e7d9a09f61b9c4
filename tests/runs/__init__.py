"""Runs: the Logbook, rollback past loss spikes, and reading a run back."""
