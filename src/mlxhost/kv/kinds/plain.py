"""The plain attention kind, mlx-lm's `KVCache` (a request's) and `BatchKVCache` (the decode batch's). Its
layers take the "kv" role in a block (kv/roles/kv.py), as quantized ones (quantized.py) do.

MLA has no cache class of its own: DeepSeek's layers are `KVCache`s whose keys (the latent) and values (the
rope part) differ in width. The spec records both widths; only --kv-bits tells them apart (kv_quant.py).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxhost.kv.kinds.registry import KV, CacheKind, LayerSpec


def _spec(c: Any) -> LayerSpec | None:
    if c.keys is None or c.keys.shape[1] != c.values.shape[1]:
        return None
    return LayerSpec(KV, (c.keys.shape[1], c.keys.shape[3], c.values.shape[3], c.keys.dtype), quant=(0, 0))


PLAIN = CacheKind("plain", (KVCache,), (BatchKVCache,), can_batch=True, can_pad=True, can_rewind=True,
                  can_store=True, can_quantize=True, can_reserve=True, spec=_spec)


def cat(keys: mx.array, values: mx.array) -> mx.array:
    return mx.concatenate([keys, values], axis=-1)
