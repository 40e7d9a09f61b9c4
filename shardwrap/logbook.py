"""``python -m shardwrap.logbook FOLDER [FOLDER]``: summarise logged runs and redraw their plots.

The logbook itself is :class:`shardwrap.Logbook` (``shardwrap/runs/logbook.py``); this module is
its command line and re-exports it.
"""

from __future__ import annotations

from pathlib import Path

from .runs import runlog
from .runs.logbook import Logbook, SpikeError, Spikes

__all__ = ["Logbook", "SpikeError", "Spikes", "main", "summary"]


def summary(*folders: str | Path) -> str:
    """A table of the runs logged in ``folders``, one column each (what the command prints)."""
    return runlog.summary([runlog.read(Path(folder)) for folder in folders])


def main(argv: list[str] | None = None) -> None:
    """Summarise one run, or two side by side, and redraw their plots."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m shardwrap.logbook", description=main.__doc__)
    parser.add_argument("folders", nargs="+", type=Path, help="one run folder, or two to compare")
    parser.add_argument("--no-plots", action="store_true", help="print the summary only")
    args = parser.parse_args(argv)
    if len(args.folders) > 2:
        parser.error("give one run folder, or two to compare side by side")
    print(summary(*args.folders))
    if not args.no_plots:
        for folder in args.folders:
            runlog.draw(folder)
            print(f"drew {folder / 'loss.png'} and {folder / 'system.png'}")


if __name__ == "__main__":
    main()
