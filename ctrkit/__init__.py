"""CTR benchmark kit: data sources, exact evaluation, straggler injection and events from child processes.

Serves the benchmark harness, the examples and the tests; the shadowgba runtime never imports it.
"""
