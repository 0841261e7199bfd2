"""The LLM layer: providers, token counting, pricing, the semantic cache, failure analysis.

Empty until the LLM layer lands. It may import ``store``, ``local`` and
``engine``, and knows nothing of the HTTP API. Needs the ``llm`` extra.
"""
