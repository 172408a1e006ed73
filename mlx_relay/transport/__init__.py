"""How ranks reach each other: ring hops, doorbells, and the side channel (hub and link).

Moves bytes and liveness between ranks; knows the wire formats of `protocol`, but
nothing of models, requests or text.
"""
