"""Wire formats only: the step header, side-channel messages, the gRPC `.proto` and its
stubs, and the other facts every process must agree on. No MLX compute, no I/O policy.
"""
