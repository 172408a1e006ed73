"""Rank 0's engine: scheduling, the pipeline driver, sampling, prompt caching, and
turning tokens into output (stop strings, reasoning, tool calls).

Front doors (`api`) sit above it; it never imports them.
"""
