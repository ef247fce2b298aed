"""What a distributed server is told on its command line."""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("ring", "jaccl", "mpi", "nccl")
# Backends whose groups have send / recv (MLX 0.32.4's NCCL backend raises "Send not supported").
SENDRECV_BACKENDS = ("ring", "jaccl", "mpi")
# Families pipelined by our own stage forward (distributed/pipeline.py), on any backend.
STAGE_FAMILIES = ("qwen2", "qwen3")
# How a pipeline stage hands its activations on: auto (send/recv where the backend has them), or one
# all-gather per stage (every backend).
HANDOFFS = ("auto", "sendrecv", "gather")


def can_stage(model_type: str | None) -> bool:
    return model_type in STAGE_FAMILIES


def choose_handoff(handoff: str, backend: str) -> str:
    if handoff == "auto":
        return "sendrecv" if backend in SENDRECV_BACKENDS else "gather"
    return handoff


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
    # auto: send/recv between stages where the backend has them, else all-gathers (NCCL).
    pipeline_handoff: str = "auto"

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1 or self.pipeline_parallel < 1:
            raise ValueError("--tensor-parallel and --pipeline-parallel must be >= 1")
        if self.tensor_parallel > 1 and self.pipeline_parallel > 1:
            # mlx-lm shards a model one way or the other over the whole group, not both at once.
            raise ValueError("--tensor-parallel and --pipeline-parallel cannot be combined (mlx-lm shards over "
                             "one group one way)")
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}")
        if self.pipeline_handoff not in HANDOFFS:
            raise ValueError(f"--pipeline-handoff must be one of {', '.join(HANDOFFS)}")
        if self.pipeline_handoff == "sendrecv" and self.backend not in SENDRECV_BACKENDS:
            raise ValueError(f"MLX's {self.backend} backend has no send/recv: use --pipeline-handoff gather (or auto)")
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
                   help="split every layer over N ranks (mlx-lm's shard()); on one host mlxhost starts the ranks,"
                        " over several hosts start it with mlx.launch (docs/distributed.md)")
    p.add_argument("--pipeline-parallel", type=int, default=1, metavar="N",
                   help="split the layers into N stages, one per rank (qwen2 and qwen3 on any backend; the other"
                        " families mlx-lm pipelines, deepseek_v2/v3, glm4_moe, ..., over send/recv backends)")
    p.add_argument("--backend", choices=BACKENDS, default=d.backend,
                   help="mx.distributed backend of --tensor-parallel / --pipeline-parallel (ring: TCP over"
                        " Ethernet or Thunderbolt; jaccl: Thunderbolt RDMA; nccl: CUDA GPUs)")
    p.add_argument("--pipeline-handoff", choices=HANDOFFS, default=d.pipeline_handoff,
                   help="how a pipeline stage passes its activations on: send/recv (ring, jaccl, mpi) or one"
                        " all-gather per stage (every backend; NCCL has no send/recv); auto picks")
    p.add_argument("--distributed-timeout", type=float, default=d.step_timeout_s, metavar="SECONDS",
                   help="a step the other ranks do not answer within this ends the server (503s, exit)")


def distributed_config(args) -> DistributedConfig:
    return DistributedConfig(tensor_parallel=args.tensor_parallel, pipeline_parallel=args.pipeline_parallel,
                             backend=args.backend, step_timeout_s=args.distributed_timeout,
                             pipeline_handoff=args.pipeline_handoff)
