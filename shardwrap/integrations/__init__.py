"""Integrations with other libraries: Hugging Face ``transformers`` (``hf.py``), which registers
its habits with the engine (``engine/extensions.py``) when imported. May import every other
package; only ``shardwrap/__init__.py`` and the public modules import it.
"""
