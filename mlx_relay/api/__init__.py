"""Front doors over rank 0's engine: the gRPC servicer, its server and auth.

Translates messages to engine calls and back; all generation logic stays in
`coordinator`, so every front door serves the same engine the same way.
"""
