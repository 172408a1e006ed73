"""Starting and supervising clusters: every rank's entry point (`serve`), the local
launcher, the `mlx.launch` wrapper, hostfiles, preflight checks, and the demo.
"""
