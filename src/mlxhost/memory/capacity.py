"""KV capacity: how many KV tokens running requests may hold at once. No MLX here.

The one number admission checks (`Scheduler.can_admit`) and the API's "can never fit" check reads.
memory/ owns it: set at start-up from the budget (or `--kv-budget-tokens`), lowered and restored by
the governor under memory pressure (pressure.py), lowered to the smallest rank's by a distributed
server, and lent out for a while (the warm-up's piece helper process, engine/warmup_memory.py). Everyone else
reads `tokens` through this object; nobody keeps a copy.
"""

from __future__ import annotations

from typing import Any

from mlxhost.memory.budget import kv_tokens


class KVCapacity:
    def __init__(self, tokens: int | None = None) -> None:
        self.limit = tokens  # what the budget holds (None: no limit, no budget and no --kv-budget-tokens)
        self.lent = 0  # tokens lent out until repaid: memory another process holds meanwhile

    @property
    def tokens(self) -> int | None:
        """What admission may hand out: the limit less what is lent."""
        return None if self.limit is None else max(0, self.limit - self.lent)

    def set_limit(self, value: int | None) -> None:
        """The governor and a distributed server move the limit (not `tokens`, which is less a loan); a loan
        stays out until repaid."""
        self.limit = value

    def lendable(self, keep: int) -> int:
        """Tokens that may be lent while `keep` stay for admission (0 without a limit: nothing to lend from)."""
        return 0 if self.limit is None else max(0, self.limit - self.lent - keep)

    def lend(self, tokens: int) -> None:
        if tokens < 0:
            raise ValueError("tokens must be >= 0")
        self.lent += tokens

    def repay(self, tokens: int) -> None:
        self.lent = max(0, self.lent - tokens)

    @classmethod
    def at_startup(cls, budget: Any, kv_bytes_per_token: int, override: int | None) -> "KVCapacity":
        """`--kv-budget-tokens` if given (the operator's number), else what the budget's KV share holds."""
        if override is None and budget is not None:
            override = kv_tokens(budget, kv_bytes_per_token)
        return cls(override)

    def __repr__(self) -> str:
        return f"KVCapacity({self.limit}{f', {self.lent} lent' if self.lent else ''})"
