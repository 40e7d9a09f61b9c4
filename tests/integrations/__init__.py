"""Hugging Face models, ``transformers.Trainer`` and ``accelerate`` on sharded models."""
