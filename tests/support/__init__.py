"""What the tests share, so that no test module imports another: ranks as threads (``ranks``),
hybrid meshes (``hybrid``), allocation tracking (``memory``), small models (``models``), the
parity loop and its cases (``parity``), the peers tier's harness and models (``peers``,
``peer_models``), optimizers that check themselves (``optimizers``), the Logbook tests' data
(``stream``) and launches under torchrun (``launch``)."""
