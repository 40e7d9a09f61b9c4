"""The public API of a wrapped model and the errors bad input gets."""
