"""Checkpoints of other libraries in and out of jaxpar.

``jaxpar.interop.hf``: Hugging Face Llama (``import_hf``, ``export_hf``, ``llama_model``); it
needs the ``safetensors`` package (``pip install 'jaxpar[hf]'``), imported only when a file is
read or written, so ``import jaxpar`` works without it.
"""
