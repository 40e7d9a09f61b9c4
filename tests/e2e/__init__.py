"""End to end, in processes of their own (most under ``torchrun``): the process tier
(``pytest -m process``) and the fault tier (``pytest -m faults``), and the scripts they launch
(``scripts/``)."""
