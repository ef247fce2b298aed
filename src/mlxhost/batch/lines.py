"""A batch's input file read into its request lines, and the output and error lines in OpenAI's shapes."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

# The endpoints a batch may target (OpenAI's, less the ones this server does not serve).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
MAX_NUM_LINES = 50_000  # OpenAI's limit per batch
EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."


@dataclass(frozen=True)
class Line:
    custom_id: str
    body: dict


class InputError(Exception):
    """The input file cannot run: its `errors` are OpenAI's batch error objects."""

    def __init__(self, errors: list[dict]) -> None:
        super().__init__(errors[0]["message"])
        self.errors = errors


def _error(code: str, message: str, line: int | None = None, param: str | None = None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}


def parse_lines(data: bytes, endpoint: str) -> list[Line]:
    """Every line checked as OpenAI checks them at validation: JSON with a unique `custom_id`, `method` POST,
    `url` the batch's endpoint and an object `body`. Raises InputError listing what failed (line numbers from 1)."""
    errors, lines, seen = [], [], set()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError([_error("invalid_file_format", "the input file is not UTF-8 text")]) from None
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except ValueError:
            errors.append(_error("invalid_json_line", "This line is not parseable as valid JSON.", number))
            continue
        if not isinstance(item, dict):
            errors.append(_error("invalid_json_line", "Each line must be a JSON object.", number))
            continue
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            errors.append(_error("missing_required_parameter", "custom_id is required (a string).", number,
                                 "custom_id"))
        elif custom_id in seen:
            errors.append(_error("duplicate_custom_id", f"The custom_id {custom_id!r} appears more than once: "
                                 "each request needs its own.", number, "custom_id"))
        seen.add(custom_id)
        if item.get("method") != "POST":
            errors.append(_error("invalid_method", "method must be POST.", number, "method"))
        if item.get("url") != endpoint:
            errors.append(_error("invalid_url", f"url must be the batch's endpoint, {endpoint}.", number, "url"))
        body = item.get("body")
        if not isinstance(body, dict):
            errors.append(_error("missing_required_parameter", "body is required (an object).", number, "body"))
        elif body.get("stream"):
            errors.append(_error("invalid_request", "stream is not supported in a batch.", number, "body.stream"))
        if not errors:
            lines.append(Line(custom_id, body))
    if not errors and not lines:
        errors.append(_error("empty_file", "The input file has no requests."))
    if len(lines) > MAX_NUM_LINES:
        errors.append(_error("too_many_requests", f"A batch holds at most {MAX_NUM_LINES} requests."))
    if errors:
        raise InputError(errors[:1000])
    return lines


def answer_line(custom_id: str, status: int, body: dict) -> dict:
    """An answered request as OpenAI writes it to the output file (2xx) or the error file."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": uuid.uuid4().hex, "body": body}, "error": None}


def expired_line(custom_id: str) -> dict:
    """A request left unanswered when its batch expired (error file)."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": "batch_expired", "message": EXPIRED_MESSAGE}}
