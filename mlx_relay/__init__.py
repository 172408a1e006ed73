"""mlx-relay: a large language model split by layers across machines with MLX."""

import os

# gRPC's core installs fork handlers unless told not to (its Python layer supports no
# fork). When a launcher forks a rank while one of its gRPC channels is busy, the child's
# handler may restart a poller on a descriptor that `close_fds` has closed and abort the
# child before it execs (grpcio >= 1.80, grpc/grpc#43055; seen once in a CI run here as
# "rank 0 killed by SIGABRT"). mlx-relay never uses gRPC across a fork, so its processes
# turn the handlers off before grpc loads.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
