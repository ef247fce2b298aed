"""The typed error of a request the server refuses or fails: an HTTP status, a message, the offending
field and a code. Request processing raises it; each front door writes it in its dialect's shape."""

from __future__ import annotations


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


# Values a client sent are echoed at most this long: a 10 MB model name must not come back whole.
MAX_ECHO_CHARS = 200


def clip(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """`value` as text, cut to `limit` characters with a note saying how long it was."""
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
