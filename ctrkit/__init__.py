"""CTR benchmark kit: data sources, exact evaluation and straggler injection.

Serves the benchmark harness, the examples and the tests; the shadowgba runtime never imports it.
"""
