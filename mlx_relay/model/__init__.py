"""A rank's share of the model: sharding, one stage's forward, KV caches, memory, the
default model, and how layers are split over ranks.

Shared by rank 0 and the workers; knows nothing of gRPC, requests or transport.
"""
