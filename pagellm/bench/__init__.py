"""``pagellm bench``: benchmarks any OpenAI-compatible server (``serve``) and pagellm in-process (``throughput``,
``latency``).

One module per noun: ``datasets`` (what is sent), ``client`` (how one request is sent and timed), ``metrics``
(percentiles, goodput), ``cpu`` (the server's CPU and memory, sampled over its process tree), ``serve`` /
``throughput`` / ``latency`` (the three commands), ``plot`` (PNG charts). Results are plain JSON-able dicts.
"""
