"""API keys with policies (`--api-keys FILE`): per key, the models and MCP servers it may use, its priority
class, its request, token and concurrency limits and its prefix-cache group; and, top-level, the system prompts
every cache group shares (`shared_prefixes:`).

The file is YAML (or JSON, which YAML reads too), a list under `keys:`; every field but `key` is optional,
and an absent limit is no limit. It is read again when it changes (checked at each request) or on SIGHUP;
a file that no longer parses keeps the keys in force and logs why. `--api-key` keys are unlimited entries.
Usage is kept per key *name*, so it survives a reload, and /metrics counts by name, never by key.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import os
import time
from contextvars import ContextVar
from dataclasses import dataclass, field, fields
from typing import Any, AsyncIterator, Callable

from mlxhost.frontends.common.errors import APIError
from mlxhost.frontends.common.shared_prefixes import SharedPrefixes

log = logging.getLogger(__name__)

WINDOW_S = 60.0  # requests_per_minute and tokens_per_minute count over a sliding minute


@dataclass(frozen=True)
class KeyPolicy:
    """One key's entry: plain data, on `request.state.api_key` for the handlers (the Batch API reads its
    priority, the MCP tools its `mcp_servers`). None: no limit, every model, every MCP server."""

    key: str = field(repr=False)
    name: str = ""
    models: tuple[str, ...] | None = None
    mcp_servers: tuple[str, ...] | None = None
    priority: int | None = None  # the scheduler's class (lower first); a request may ask for a worse one only
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # prompt + completion tokens, counted when a request ends
    max_concurrent: int | None = None
    cache_group: str | None = None  # `--cache-isolation group`: keys of one group share prefix-cache blocks

    def allows_model(self, *names: str) -> bool:
        return self.models is None or any(n in self.models for n in names)


def _digest(value: bytes) -> bytes:
    # Hashing first makes every comparison the same length, so timing leaks neither bytes nor length.
    return hashlib.sha256(value).digest()


def _default_name(key: str) -> str:
    # A name that identifies the key in logs and /metrics without revealing it.
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def _names(value: Any, what: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{what} must be a list of names")
    return tuple(value)


def _limit(value: Any, what: str, minimum: int = 1) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}")
    return value


def _load_yaml(text: str) -> Any:
    import yaml  # a dependency already (--models-config); imported here, where the file is read

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # PyYAML's own message quotes the offending line, which may hold a key: only the problem and its line.
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"not YAML or JSON{where}: {getattr(exc, 'problem', None) or 'cannot be parsed'}") from None


def parse_key_file(text: str) -> tuple[KeyPolicy, ...]:
    """The policies of a key file's text (YAML or JSON); ValueError says what is wrong, never a key."""
    return _policies(_load_yaml(text))


def parse_shared_prefixes(text: str, folder: str = ".") -> tuple[str, ...]:
    """The file's `shared_prefixes:`: system prompts every cache group shares (shared_prefixes.py), each a text
    or `{file: NAME}` (read relative to `folder`, the key file's)."""
    data = _load_yaml(text)
    entries = data.get("shared_prefixes") if isinstance(data, dict) else None
    if entries is None:
        return ()
    if not isinstance(entries, list):
        raise ValueError("shared_prefixes must be a list of texts or {file: NAME}")
    texts = []
    for i, entry in enumerate(entries):
        if isinstance(entry, dict) and set(entry) == {"file"} and isinstance(entry["file"], str):
            try:
                with open(os.path.join(folder, entry["file"]), encoding="utf-8") as f:
                    entry = f.read()
            except OSError as exc:
                raise ValueError(f"shared_prefixes[{i}]: {exc.strerror}: {entry['file']}") from None
        if not isinstance(entry, str) or not entry:
            raise ValueError(f"shared_prefixes[{i}] must be a non-empty text or {{file: NAME}}")
        texts.append(entry)
    return tuple(texts)


def _policies(data: Any) -> tuple[KeyPolicy, ...]:
    entries = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError("the file must hold a list under `keys:`")
    known = {f.name for f in fields(KeyPolicy)}
    policies, names, seen = [], set(), set()
    for i, entry in enumerate(entries):
        where = f"keys[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be a mapping")
        unknown = sorted(set(entry) - known)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
        key = entry.get("key")
        if not isinstance(key, str) or not key or key != key.strip():
            raise ValueError(f"{where}: `key` must be a non-empty string without surrounding whitespace")
        if key in seen:
            raise ValueError(f"{where}: the same key appears twice")
        name = entry.get("name") or _default_name(key)
        if not isinstance(name, str) or name in names:
            raise ValueError(f"{where}: `name` must be a string, unique in the file")
        priority = entry.get("priority")
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
            raise ValueError(f"{where}: priority must be an integer")
        group = entry.get("cache_group")
        if group is not None and not (isinstance(group, str) and group):
            raise ValueError(f"{where}: cache_group must be a non-empty string")
        policies.append(KeyPolicy(
            key=key, name=name, models=_names(entry.get("models"), f"{where}.models"),
            mcp_servers=_names(entry.get("mcp_servers"), f"{where}.mcp_servers"), priority=priority,
            requests_per_minute=_limit(entry.get("requests_per_minute"), f"{where}.requests_per_minute"),
            tokens_per_minute=_limit(entry.get("tokens_per_minute"), f"{where}.tokens_per_minute"),
            max_concurrent=_limit(entry.get("max_concurrent"), f"{where}.max_concurrent"), cache_group=group))
        seen.add(key)
        names.add(name)
    return tuple(policies)


@dataclass(frozen=True)
class Refusal:
    limit: str  # "requests", "tokens" or "concurrency"
    message: str
    retry_after_s: int


class KeyUsage:
    """One key name's sliding-minute windows and requests in flight. Touched only on the event loop."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.request_times: collections.deque[float] = collections.deque()
        self.token_counts: collections.deque[tuple[float, int]] = collections.deque()
        self.num_tokens = 0
        self.num_in_flight = 0

    def _expire(self, now: float) -> None:
        while self.request_times and self.request_times[0] <= now - WINDOW_S:
            self.request_times.popleft()
        while self.token_counts and self.token_counts[0][0] <= now - WINDOW_S:
            self.num_tokens -= self.token_counts.popleft()[1]

    def _tokens_free_in(self, limit: int, now: float) -> float:
        """Seconds until the window's tokens fall under `limit`."""
        left = self.num_tokens
        for at, n in self.token_counts:
            left -= n
            if left < limit:
                return at + WINDOW_S - now
        return 0.0

    def admit(self, policy: KeyPolicy, in_flight: bool = True) -> Refusal | None:
        """Counts a new request in, or says which limit refuses it and when to come back. `in_flight`: False for a
        read (GET) that neither waits for nor takes a `max_concurrent` slot (the caller then skips release())."""
        now = self.clock()
        self._expire(now)
        if in_flight and policy.max_concurrent is not None and self.num_in_flight >= policy.max_concurrent:
            return Refusal("concurrency", f"this key has {self.num_in_flight} requests running, its limit is "
                           f"{policy.max_concurrent}", 1)
        rpm = policy.requests_per_minute
        if rpm is not None and len(self.request_times) >= rpm:
            wait = self.request_times[-rpm] + WINDOW_S - now
            return Refusal("requests", f"this key is limited to {rpm} requests per minute", _seconds(wait))
        tpm = policy.tokens_per_minute
        if tpm is not None and self.num_tokens >= tpm:
            return Refusal("tokens", f"this key used {self.num_tokens} tokens in the last minute, its limit is "
                           f"{tpm} per minute", _seconds(self._tokens_free_in(tpm, now)))
        self.request_times.append(now)
        self.num_in_flight += in_flight
        return None

    def release(self) -> None:
        self.num_in_flight -= 1

    def add_tokens(self, n: int) -> None:
        if n > 0:
            self.token_counts.append((self.clock(), n))
            self.num_tokens += n

    def rate_headers(self, policy: KeyPolicy, anthropic: bool) -> list[tuple[bytes, bytes]]:
        """OpenAI's `x-ratelimit-*` headers (Anthropic's `anthropic-ratelimit-*` on its routes) for the
        limits the key has."""
        now = self.clock()
        self._expire(now)
        out = []
        for kind, limit, used, reset in (
                ("requests", policy.requests_per_minute, len(self.request_times),
                 self.request_times[0] + WINDOW_S - now if self.request_times else 0.0),
                ("tokens", policy.tokens_per_minute, self.num_tokens,
                 self.token_counts[0][0] + WINDOW_S - now if self.token_counts else 0.0)):
            if limit is None:
                continue
            if anthropic:
                reset_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + reset))
                out += [(f"anthropic-ratelimit-{kind}-limit", str(limit)),
                        (f"anthropic-ratelimit-{kind}-remaining", str(max(limit - used, 0))),
                        (f"anthropic-ratelimit-{kind}-reset", reset_at)]
            else:
                out += [(f"x-ratelimit-limit-{kind}", str(limit)),
                        (f"x-ratelimit-remaining-{kind}", str(max(limit - used, 0))),
                        (f"x-ratelimit-reset-{kind}", f"{max(reset, 0.0):.3g}s")]
        return [(k.encode(), v.encode()) for k, v in out]


def _seconds(wait: float) -> int:
    return max(1, int(wait + 0.999))


@dataclass(frozen=True)
class KeyGrant:
    """What the gate hands the request path for a matched key: its policy, its usage (tokens are added
    when the request ends) and the prefix-cache group it reads and writes ('' shares with everyone)."""

    policy: KeyPolicy
    usage: KeyUsage
    cache_group: str = ""
    shared: SharedPrefixes | None = None  # system prompts shared across groups (only with a group)

    def request_priority(self, asked: int | None) -> int:
        """The scheduling class: the request's own, never better than its key's."""
        if self.policy.priority is None:
            return asked or 0
        return max(self.policy.priority, asked) if asked is not None else self.policy.priority

    def check_model(self, requested: str, resolve: Callable[[str], str] | None = None) -> None:
        """404 (OpenAI's model_not_found, as for a model that is not served: a key learns nothing about the
        models it may not use) unless the key may use `requested` (by the name asked or the one it resolves to)."""
        if self.policy.models is None:
            return
        names = [requested]
        if resolve is not None:
            try:
                names.append(resolve(requested))
            except Exception:  # not served at all: the lease answers that in its own words
                pass
        if not self.policy.allows_model(*names):
            raise APIError(404, f"The model `{requested}` does not exist or you do not have access to it.",
                           "model", "model_not_found")

    def visible_cards(self, cards: list[dict]) -> list[dict]:
        """The model list's entries of the models this key may use (by id or an alias): a key limited to some
        models sees only those, as a request for another would get model_not_found."""
        if self.policy.models is None:
            return cards
        return [c for c in cards if self.policy.allows_model(c["id"], *c.get("aliases") or ())]

    async def count_tokens(self, outputs: AsyncIterator, metrics: Any = None) -> AsyncIterator:
        """`outputs`, passed through; the request's prompt + completion tokens are added when it ends (or is
        dropped), so a limit sees what a request cost, never a guess."""
        last = None
        try:
            async for out in outputs:
                last = out
                yield out
        finally:
            if last is not None:
                n = last.num_prompt_tokens + last.num_output_tokens
                self.usage.add_tokens(n)
                if metrics is not None:
                    metrics.key_tokens.labels(self.policy.name).inc(n)
            closing = getattr(outputs, "aclose", None)  # an engine stream aborts its request on close
            if closing is not None:
                await closing()


# The grant of the request being handled, set by the gate (security.py) for the handler's task, which
# it runs in: the gateway reads it to set the request's priority and cache group and count its tokens.
current_grant: ContextVar[KeyGrant | None] = ContextVar("current_grant", default=None)

def visible_cards(cards: list[dict]) -> list[dict]:
    """`cards` as the request's key sees them (every card without keys or for an unlimited key)."""
    grant = current_grant.get()
    return cards if grant is None else grant.visible_cards(cards)


CACHE_ISOLATION = ("none", "key", "group")


class KeyRing:
    """The keys in force: the file's, reloaded when it changes or on SIGHUP, and `--api-key`'s, unlimited."""

    def __init__(self, path: str | None = None, plain_keys: tuple[str, ...] = (), cache_isolation: str = "none",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if cache_isolation not in CACHE_ISOLATION:
            raise ValueError(f"cache isolation must be one of {', '.join(CACHE_ISOLATION)}")
        self.path, self.cache_isolation, self.clock = path, cache_isolation, clock
        self._plain = tuple(KeyPolicy(key=k, name=_default_name(k)) for k in plain_keys)
        self._usage: dict[str, KeyUsage] = {}
        self._stamp: tuple[int, int] | None = None
        self._entries: tuple[tuple[bytes, KeyPolicy], ...] = ()
        self.policies: tuple[KeyPolicy, ...] = ()
        self.shared = SharedPrefixes(())
        if path is not None:
            self._install(*load_key_file(path), self._file_stamp())  # at start-up a bad file is fatal
        else:
            self._install((), (), None)

    def __len__(self) -> int:
        return len(self._entries)

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def _install(self, policies: tuple[KeyPolicy, ...], shared: tuple[str, ...], stamp) -> None:
        if shared != self.shared.texts:
            self.shared = SharedPrefixes(shared)
        file_keys = {p.key for p in policies}
        self.policies = (*policies, *(p for p in self._plain if p.key not in file_keys))
        self._entries = tuple((_digest(p.key.encode()), p) for p in self.policies)
        self._stamp = stamp

    def reload(self) -> bool:
        """Reads the file again; a file that does not parse leaves the keys as they were. True if it did."""
        if self.path is None:
            return False
        stamp = self._file_stamp()
        try:
            policies, shared = load_key_file(self.path)
        except (OSError, ValueError) as exc:
            log.error("API key file %s not reloaded, the keys in force stay: %s", self.path, exc)
            self._stamp = stamp  # not retried at every request; the next change is
            return False
        self._install(policies, shared, stamp)
        log.info("API key file %s reloaded: %d keys", self.path, len(policies))
        return True

    def reload_soon(self) -> None:
        """Makes the next request read the file again (SIGHUP: a signal handler must not do the reading)."""
        self._stamp = (-1, -1)

    def reload_if_changed(self) -> None:
        if self.path is not None and self._file_stamp() != self._stamp:
            self.reload()

    def match(self, candidates: list[bytes]) -> KeyPolicy | None:
        """The policy of the first candidate that is a key; every key is compared (no early exit)."""
        found = None
        for candidate in candidates:
            digest = _digest(candidate)
            for key_digest, policy in self._entries:
                if hmac.compare_digest(digest, key_digest) and found is None:
                    found = policy
        return found

    def named(self, name: str) -> KeyPolicy | None:
        """The policy in force under `name` (work queued by a key, such as a batch, runs under its policy now)."""
        return next((p for p in self.policies if p.name == name), None)

    def grant(self, policy: KeyPolicy) -> KeyGrant:
        usage = self._usage.get(policy.name)
        if usage is None:
            usage = self._usage[policy.name] = KeyUsage(self.clock)
        group = ""
        if self.cache_isolation == "key":
            group = "key:" + policy.name
        elif self.cache_isolation == "group":
            group = "group:" + policy.cache_group if policy.cache_group else "key:" + policy.name
        return KeyGrant(policy, usage, group, self.shared if group and self.shared else None)


def load_key_file(path: str) -> tuple[tuple[KeyPolicy, ...], tuple[str, ...]]:
    """The file's policies and shared prefixes."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return parse_key_file(text), parse_shared_prefixes(text, os.path.dirname(path))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
