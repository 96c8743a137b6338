"""pagellm's gRPC API: ``pagellm.proto`` (the contract), its generated modules, and ``service.py``."""
