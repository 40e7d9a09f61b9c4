"""Integrations with other libraries: Hugging Face ``transformers`` (``hf.py``) and
``accelerate`` (``hf_accelerate.py``), which register their habits and checks with the engine
(``engine/wrap/extensions.py``) when imported. May import every other package; only
``shardwrap/__init__.py`` and the public modules import it.
"""
