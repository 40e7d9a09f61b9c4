"""shardwrap's test suite; run it with ``make test``."""
