"""KV capacity: how many KV tokens running requests may hold at once. No MLX here.

The one number admission checks (`Scheduler.can_admit`) and the API's "can never fit" check reads.
memory/ owns it: set at start-up from the budget (or `--kv-budget-tokens`), lowered and restored by
the governor under memory pressure (pressure.py), lowered to the smallest rank's by a distributed
server. Everyone else reads `tokens` through this object; nobody keeps a copy.
"""

from __future__ import annotations

from typing import Any

from mlxhost.memory.budget import kv_tokens


class KVCapacity:
    def __init__(self, tokens: int | None = None) -> None:
        self.tokens = tokens  # None: no limit (no budget and no --kv-budget-tokens)

    @classmethod
    def at_startup(cls, budget: Any, kv_bytes_per_token: int, override: int | None) -> "KVCapacity":
        """`--kv-budget-tokens` if given (the operator's number), else what the budget's KV share holds."""
        if override is None and budget is not None:
            override = kv_tokens(budget, kv_bytes_per_token)
        return cls(override)

    def __repr__(self) -> str:
        return f"KVCapacity({self.tokens})"
