"""The peers tier: behaviours that PyTorch FSDP2's and DeepSpeed ZeRO's own suites assert,
ported to shardwrap and checked against the plain model at stages 1, 2 and 3 (``pytest -m
peers``; the list: ``docs/tests.md``)."""
