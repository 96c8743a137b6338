"""Anthropic's Messages API (``/v1/messages``), served over the chat pipeline as vLLM serves it."""
