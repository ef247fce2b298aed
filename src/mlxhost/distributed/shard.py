"""Loading this rank's part of a model: mlx-lm's `Model.shard(group)` (tensor parallel); for pipeline
parallel our stage (pipeline.py: Qwen2, Qwen3, any backend) or else mlx-lm's `Model.model.pipeline(group)`.

The model is built lazily first, then sharded, then evaluated: a tensor-parallel rank materializes
only its slices, a pipeline rank only its layers (the others are dropped before anything is read).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from mlxhost.distributed.config import SENDRECV_BACKENDS, STAGE_FAMILIES, DistributedConfig, can_stage, choose_handoff
from mlxhost.models.encoder import encoder_type
from mlxhost.models.loader import LoadedModel, check_safetensors, materialize, weight_files
from mlxhost.models.vlm import is_vlm_config

log = logging.getLogger(__name__)


def local_folder(source: str) -> Path:
    """A model folder on this host; a hub id is fetched (whole) into the Hugging Face cache first."""
    path = Path(source)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download  # lazy: huggingface_hub only when used

    return Path(snapshot_download(source))


def fingerprint(folder: Path) -> str:
    """What must be equal on every rank: config.json and the weight files' names and sizes (not paths
    or modification times, which differ between machines holding the same model)."""
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in weight_files(folder):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def check_shardable(config: dict, dist: DistributedConfig) -> None:
    """Refuses what mlx-lm cannot split this way, before any weight is read."""
    if is_vlm_config(config) or encoder_type(config) is not None:
        raise ValueError("tensor / pipeline parallel serve text generation models only (mlx-lm families)")
    tp = dist.tensor_parallel
    cfg = config.get("text_config", config)
    if dist.pipeline_parallel > 1 and not can_stage(cfg.get("model_type")):
        if dist.backend not in SENDRECV_BACKENDS:
            raise ValueError(f"--pipeline-parallel over {dist.backend} serves {', '.join(STAGE_FAMILIES)} models; "
                             f"mlx-lm's own pipeline of {cfg.get('model_type')} needs send/recv (--backend ring)")
        if dist.pipeline_handoff == "gather":
            raise ValueError(f"--pipeline-handoff gather serves {', '.join(STAGE_FAMILIES)} models only")
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = cfg.get(key)
        if tp > 1 and heads and heads % tp:
            raise ValueError(f"--tensor-parallel {tp} does not divide the model's {key} ({heads})")


def drop_gradient_hooks(model: Any) -> int:
    """mlx's `AllToShardedLinear` (what `shard()` makes of q/k/v, gate and up projections) wraps its input in
    `sum_gradients(group)` on every call: a custom-function node in the graph, identity forward, all-reduce
    of the gradient backward. Serving has no backward, and a 64-layer model pays 320 of them a step in host
    time (adding and evaluating the nodes). Each becomes an `nn.Linear` holding the same arrays: the same matmul.
    The quantized shards are left as they are (platform/quantized_rows.py folds those). Returns how many."""
    import mlx.nn as nn  # lazy: mlx only when used
    from mlx.nn.layers.distributed import AllToShardedLinear  # lazy: mlx only when used
    from mlx.utils import tree_map_with_path  # lazy: mlx only when used

    replaced = 0

    def swap(_path, layer):
        nonlocal replaced
        if type(layer) is not AllToShardedLinear:
            return layer
        new = nn.Linear(1, 1, bias=False)  # a 1x1 placeholder matrix, replaced by the shard's own below
        new.weight = layer.weight
        if "bias" in layer:
            new.bias = layer.bias
        replaced += 1
        return new

    leaves = tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module)
    if replaced:
        model.update_modules(leaves)
    return replaced


def load_sharded(source: str, group: Any, dist: DistributedConfig) -> LoadedModel:
    from mlx_lm.utils import load_model, load_tokenizer  # lazy: mlx_lm only when used

    from mlxhost.distributed.pipeline import make_stage  # lazy: pulls in mlx
    from mlxhost.platform.quantized_rows import fold_on_cuda  # lazy: pulls in mlx

    folder = local_folder(source)
    for path in weight_files(folder):
        check_safetensors(path)
    config = json.loads((folder / "config.json").read_text())
    check_shardable(config, dist)
    start = time.perf_counter()
    model, config = load_model(folder, lazy=True)
    model_type = config.get("model_type")
    if dist.tensor_parallel > 1:
        if not hasattr(model, "shard"):
            raise ValueError(f"mlx-lm's {model_type} model cannot be tensor-parallel (it has no shard()); "
                             "try --pipeline-parallel if it pipelines")
        model.shard(group)
        drop_gradient_hooks(model)
    elif can_stage(model_type):  # our stage forward: its hand-off works on every backend
        make_stage(model, group, choose_handoff(dist.pipeline_handoff, dist.backend))
    else:  # mlx-lm's own pipeline: send / recv between stages (check_shardable refused it where there are none)
        if not hasattr(getattr(model, "model", None), "pipeline"):
            raise ValueError(f"mlx-lm's {model_type} model cannot be pipelined (it has no pipeline()); "
                             "try --tensor-parallel")
        model.model.pipeline(group)
    materialize(model)
    fold_on_cuda(model)  # after sharding: tensor-parallel layers fold as well
    weights_s = time.perf_counter() - start
    tokenizer = load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))
    log.info("rank %d/%d loaded its %s shard of %s in %.2f s", group.rank(), group.size(), dist.layout, source,
             weights_s)
    return LoadedModel(model, tokenizer, config, source, "sharded", {"weights": weights_s})


def load_text_side(source: str) -> LoadedModel:
    """The tokenizer and config.json of a model, no weights (rank 0 loads its shard on its engine
    thread): what the HTTP side needs to start."""
    from mlx_lm.utils import load_tokenizer  # lazy: mlx_lm only when used

    folder = local_folder(source)
    config = json.loads((folder / "config.json").read_text())
    tokenizer = load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))
    return LoadedModel(None, tokenizer, config, source, "sharded")
