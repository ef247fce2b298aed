"""Cache roles: how a prefix-cache block holds each role's layers (base.py says what a role owns).

`ROLES` is the one registry; `KVLayout.roles` gives a model's. Adding a role is one module with its
`CacheRole` (and the cache kinds it brings, registered with it) plus one entry in the list below.
"""

from __future__ import annotations

from mlxhost.kv.kinds import KINDS
from mlxhost.kv.roles.base import CacheRole, RoleRegistry
from mlxhost.kv.roles.kv import KV_ROLE
from mlxhost.kv.roles.state import STATE_ROLE
from mlxhost.kv.roles.swa import SWA_ROLE

# The SSD layout's order: the states folder takes its quarter of the disk cap before the windows folder
# takes half the rest, and a block file's window mark comes before its KV.
ROLES = RoleRegistry([STATE_ROLE, SWA_ROLE, KV_ROLE], kinds=KINDS)

__all__ = ["ROLES", "CacheRole", "RoleRegistry"]
