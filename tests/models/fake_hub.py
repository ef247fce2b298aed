"""A tiny stand-in for the Hugging Face hub on 127.0.0.1: enough of its protocol for `snapshot_download`.

Serves one folder as one model repo at one commit:
  GET  /api/models/{repo}/revision/{rev}   repo info: `sha`, `siblings`
  GET  /api/models/{repo}/tree/{rev}       the file list (one page, no `Link` header)
  HEAD /{repo}/resolve/{rev}/{file}        X-Repo-Commit, ETag, Content-Length
  GET  /{repo}/resolve/{rev}/{file}        the bytes (Range requests too, as a resumed download sends)
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repo_id: str, folder: Path) -> None:
        self.repo_id = repo_id
        self.files = {p.relative_to(folder).as_posix(): p.read_bytes()
                      for p in sorted(Path(folder).rglob("*")) if p.is_file()}
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- protocol ----------------------------------------------------------------------------------
    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(h.path).path)
        self.requests.append(f"{h.command} {path}")
        api = f"/api/models/{self.repo_id}/"
        resolve = f"/{self.repo_id}/resolve/"
        if path.startswith(api + "revision/"):
            info = {"id": self.repo_id, "modelId": self.repo_id, "sha": COMMIT, "private": False,
                    "siblings": [{"rfilename": name} for name in self.files]}
            return self._send(h, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        if path.startswith(api + "tree/"):
            tree = [{"type": "file", "path": name, "size": len(data), "oid": _git_sha(data)}
                    for name, data in self.files.items()]
            return self._send(h, 200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, body)
        if path.startswith(resolve):
            _, _, name = path[len(resolve):].partition("/")
            if name not in self.files:
                return self._send(h, 404, b"", {"X-Error-Code": "EntryNotFound"}, body)
            data = self.files[name]
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{_git_sha(data)}"', "Accept-Ranges": "bytes",
                       "Content-Type": "application/octet-stream"}
            start = _range_start(h.headers.get("Range"))
            if start:
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                return self._send(h, 206, data[start:], headers, body)
            return self._send(h, 200, data, headers, body)
        return self._send(h, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body)

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict, body: bool) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)


def _git_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _range_start(header: str | None) -> int:
    if not header or not header.startswith("bytes="):
        return 0
    return int(header[len("bytes="):].split("-")[0] or 0)
