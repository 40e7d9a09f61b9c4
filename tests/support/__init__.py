"""What the tests share: ranks as threads (``ranks``), hybrid meshes (``hybrid``), allocation
tracking (``memory``) and small models (``models``). No test module imports another: what two
of them need lives here."""
