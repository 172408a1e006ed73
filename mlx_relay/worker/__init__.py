"""The worker loop: run exactly the step rank 0 describes over this rank's layers.

Workers never sample, see text or decide to stop (see the design's one rule).
"""
