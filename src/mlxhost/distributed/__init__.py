"""Serving one model split over several processes (tensor / pipeline parallel) on `mx.distributed`.

Rank 0 owns HTTP, the scheduler and the caches' logical halves; every step it sends the step's plan
(plain data) to the other ranks, and all ranks run the same runner step in lockstep through mlx-lm's
own `shard()` / `pipeline()`. The transport is mx.distributed itself (ring, JACCL, MPI, NCCL).
"""
