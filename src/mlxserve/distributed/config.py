"""What a distributed server is told on its command line."""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("ring", "jaccl", "mpi", "nccl")


@dataclass(frozen=True)
class DistributedConfig:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    # mx.distributed's backend; "ring" (TCP / Thunderbolt IP) works everywhere.
    backend: str = "ring"
    # A step (plan + forward) that takes longer than this means a rank stopped answering: the server
    # ends every stream with a 503 and exits. Generous: a long prefill chunk of a big model, or the
    # CUDA backend compiling a new shape, may legitimately take tens of seconds.
    step_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1 or self.pipeline_parallel < 1:
            raise ValueError("--tensor-parallel and --pipeline-parallel must be >= 1")
        if self.tensor_parallel > 1 and self.pipeline_parallel > 1:
            # mlx-lm shards a model one way or the other over the whole group, not both at once.
            raise ValueError("--tensor-parallel and --pipeline-parallel cannot be combined (mlx-lm shards over "
                             "one group one way)")
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}")
        if self.pipeline_parallel > 1 and self.backend == "nccl":
            # mlx-lm's pipeline passes activations with mx.distributed.send / recv, which MLX's NCCL
            # backend raises on ("Send not supported in NCCL backend", mlx 0.32.4).
            raise ValueError("--pipeline-parallel needs send/recv between stages, which MLX's NCCL backend does not "
                             "have: use --backend ring (activations between stages go through the hosts' memory "
                             "and TCP), or --tensor-parallel over nccl")
        if self.step_timeout_s <= 0:
            raise ValueError("--distributed-timeout must be > 0")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def layout(self) -> str:
        """The rank layout, part of the prefix cache's model key: blocks of another layout never match."""
        return f"tp{self.tensor_parallel}" if self.tensor_parallel > 1 else f"pp{self.pipeline_parallel}"


def add_distributed_flags(p) -> None:
    d = DistributedConfig()
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split every layer over N ranks (mlx-lm's shard()); on one host mlxserve starts the ranks,"
                        " over several hosts start it with mlx.launch (docs/distributed.md)")
    p.add_argument("--pipeline-parallel", type=int, default=1, metavar="N",
                   help="split the layers into N stages, one per rank (families mlx-lm pipelines: qwen2,"
                        " deepseek_v2/v3, glm4_moe, ...)")
    p.add_argument("--backend", choices=BACKENDS, default=d.backend,
                   help="mx.distributed backend of --tensor-parallel / --pipeline-parallel (ring: TCP over"
                        " Ethernet or Thunderbolt; jaccl: Thunderbolt RDMA; nccl: CUDA GPUs)")
    p.add_argument("--distributed-timeout", type=float, default=d.step_timeout_s, metavar="SECONDS",
                   help="a step the other ranks do not answer within this ends the server (503s, exit)")


def distributed_config(args) -> DistributedConfig:
    return DistributedConfig(tensor_parallel=args.tensor_parallel, pipeline_parallel=args.pipeline_parallel,
                             backend=args.backend, step_timeout_s=args.distributed_timeout)
