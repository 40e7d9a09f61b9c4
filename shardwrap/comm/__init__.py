"""Communication: the process groups a sharded model talks over and its compute device
(``mesh.py``), and the collectives on them, free functions that take the group explicitly
(``collectives.py``); their compressed variants (``compressed.py``) and the blockwise wire
formats these send (``quantize.py``). Imports only ``shardwrap.options`` from shardwrap; every
other package builds on it.
"""
