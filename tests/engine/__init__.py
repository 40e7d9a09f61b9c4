"""The engine: the flat layout, units, the root and its schedule, the ZeRO stages, meta-device
initialisation, mixed precision and recomputation, and training parity."""
