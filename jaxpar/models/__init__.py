"""Example models (plain Flax NNX with logical axis names).

``gpt``: the small example GPT. ``llama``: the Llama-3 family (``LlamaConfig.named("tiny")``
to ``"llama3_70b"``). ``data``: a generated arithmetic corpus to train them on.
"""
