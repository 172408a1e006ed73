"""Rank 0's engine: scheduling, the pipeline driver, sampling, prompt caching, and
turning tokens into output chunks (output.py; the text itself, stop strings, reasoning
and tool calls, is the text layer's, `mlx_relay.text`).

Front doors (`api`) sit above it; it never imports them.
"""
