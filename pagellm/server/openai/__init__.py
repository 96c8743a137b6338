"""OpenAI-compatible HTTP API: ``protocol`` (pydantic models), ``serving_completion`` and ``serving_chat`` (request
handling over the engine), ``routes`` (the FastAPI app), ``errors`` (OpenAI's error shape)."""
