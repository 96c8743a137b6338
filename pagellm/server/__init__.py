"""The network front of pagellm: the OpenAI-compatible HTTP API (``server/openai``) and ``launch.py``.

Contract: the server talks to the engine only through the ``AsyncLLM`` interface (``serving_engine.EngineClient``)
and owns everything about HTTP: request validation, chat templates, SSE streaming, auth and error shapes. Nothing
in the package imports ``pagellm.server`` except ``pagellm.cli``.
"""
