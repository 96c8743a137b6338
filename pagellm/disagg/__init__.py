"""Disaggregated prefill and decode: the KV connector (``connector.py``) and the routing proxy (``proxy.py``)."""
