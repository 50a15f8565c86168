"""Example models (plain Flax NNX with logical axis names).

``gpt``: the small example GPT. ``llama``: the Llama-3 family (``LlamaConfig.named("tiny")``
to ``"llama3_70b"``). ``data``: a generated arithmetic corpus to train them on. A model file
imports nothing parallel; what runs a model in parallel sits beside it: ``gpt_parallel`` and
``llama_parallel`` (``pipeline_loss()``: the parts a pipeline's stages run).
"""
