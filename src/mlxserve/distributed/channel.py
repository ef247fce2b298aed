"""Bytes between ranks over mx.distributed itself: rank 0 broadcasts, every rank gathers.

A broadcast is an `all_sum` of a uint8 array to which only rank 0 contributes (the others add zeros,
so the sum is rank 0's bytes exactly). The first `HEAD_BYTES` carry the length and the start of the
payload, so a step's plan (a few hundred bytes) costs one collective; a longer one a second.
"""

from __future__ import annotations

import pickle
from typing import Any

import mlx.core as mx
import numpy as np

HEAD_BYTES = 4096
_LEN = 8  # little-endian uint64 length in front of the payload


class Channel:
    def __init__(self, group: Any, device: Any = None) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        # Collectives of the ring / MPI / JACCL backends run on the CPU; NCCL's on the GPU.
        self.device = device if device is not None else mx.cpu

    def _sum(self, buf: np.ndarray) -> np.ndarray:
        out = mx.distributed.all_sum(mx.array(buf), group=self.group, stream=self.device)
        mx.eval(out)
        return np.array(out)  # a copy: the MLX buffer goes with `out`

    def broadcast_bytes(self, payload: bytes | None = None) -> bytes:
        """Rank 0 passes `payload`, the others None; every rank returns rank 0's bytes."""
        head = np.zeros(HEAD_BYTES, dtype=np.uint8)
        if self.rank == 0:
            n = len(payload)
            head[:_LEN] = np.frombuffer(n.to_bytes(_LEN, "little"), dtype=np.uint8)
            first = np.frombuffer(payload[: HEAD_BYTES - _LEN], dtype=np.uint8)
            head[_LEN : _LEN + len(first)] = first
        head = self._sum(head)
        n = int.from_bytes(head[:_LEN].tobytes(), "little")
        data = head[_LEN : _LEN + min(n, HEAD_BYTES - _LEN)].tobytes()
        rest = n - len(data)
        if rest > 0:
            tail = np.zeros(rest, dtype=np.uint8)
            if self.rank == 0:
                tail[:] = np.frombuffer(payload[HEAD_BYTES - _LEN :], dtype=np.uint8)
            data += self._sum(tail).tobytes()
        return data

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's object on every rank (pickled: the ranks are one trusted installation)."""
        return pickle.loads(self.broadcast_bytes(pickle.dumps(obj) if self.rank == 0 else None))

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's object, in rank order, on every rank (start-up checks; not per step)."""
        payload = pickle.dumps(obj)
        sizes = np.zeros(self.size, dtype=np.int64)
        sizes[self.rank] = len(payload)
        sizes = self._sum(sizes)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        buf = np.zeros(int(offsets[-1]), dtype=np.uint8)
        buf[offsets[self.rank] : offsets[self.rank + 1]] = np.frombuffer(payload, dtype=np.uint8)
        buf = self._sum(buf)
        return [pickle.loads(buf[offsets[i] : offsets[i + 1]].tobytes()) for i in range(self.size)]

    def barrier(self) -> None:
        self._sum(np.zeros(1, dtype=np.int64))
