"""HTTP front doors on rank 0: OpenAI, Anthropic and Ollama APIs, health and metrics.

Every door here translates its JSON into the typed `GenerationRequest` for the shared
`api.cluster.Cluster`, exactly as the gRPC door does, and folds the engine's chunks back
into its own wire format; see `app.py` for the wiring and `server.py` for the thread.
"""
