"""A stand-in for the Hugging Face Hub's HTTP API, enough for huggingface_hub's create_repo, create_branch and
upload_folder: it records what arrives, and can be told to answer a commit slowly or with an error.

Point HF_ENDPOINT at `url` (before huggingface_hub is imported) and every file's upload mode is 'regular', so the
files come inline in the commit request, base64-encoded."""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclasses.dataclass
class Commit:
    repo: str
    revision: str
    summary: str
    files: dict[str, bytes]
    started: float
    finished: float = 0.0
    note: Any = None  # what the test's hook returned when the commit arrived
    note_after: Any = None  # and when the stand-in was about to answer it


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, Any]] = {}
        self.branches: list[tuple[str, str]] = []
        self.commits: list[Commit] = []
        self.failed: list[Commit] = []
        self.requests: list[tuple[str, str]] = []
        self.validated: list[str] = []  # model cards sent for validation
        self.auth: set[str] = set()  # Authorization headers seen
        # Per commit, in order of arrival: seconds to wait before answering, and whether to answer 500.
        self.delays: list[float] = []
        self.failures: list[bool] = []
        self.on_commit: Callable[[Commit], Any] | None = None
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                with hub.lock:
                    hub.requests.append(("GET", self.path))
                self._reply(404, {"error": "not here"})

            def do_POST(self) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(size)
                with hub.lock:
                    hub.requests.append(("POST", self.path))
                    if self.headers.get("Authorization"):
                        hub.auth.add(self.headers["Authorization"])
                path = self.path.split("?")[0]
                if path == "/api/validate-yaml":  # the model card's metadata, checked before the commit
                    data = json.loads(body)
                    with hub.lock:
                        hub.validated.append(data.get("content", ""))
                    self._reply(200, {"errors": [], "warnings": []})
                    return
                if path == "/api/repos/create":
                    data = json.loads(body)
                    repo = f"{data.get('organization')}/{data['name']}" if data.get("organization") else data["name"]
                    with hub.lock:
                        private = bool(data.get("private")) or data.get("visibility") == "private"
                        hub.repos.setdefault(repo, {"private": private})
                    self._reply(200, {"url": f"{hub.url}/{repo}", "name": repo})
                    return
                m = re.fullmatch(r"/api/models/(.+)/(preupload|commit|branch)/(.+)", path)
                if m is None:
                    self._reply(404, {"error": f"unknown route {path}"})
                    return
                repo, what, revision = m[1], m[2], m[3]
                if what == "branch":
                    with hub.lock:
                        hub.branches.append((repo, revision))
                    self._reply(200, {})
                elif what == "preupload":
                    files = json.loads(body)["files"]
                    answer = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                    self._reply(200, {"files": answer, "commitOid": "0" * 40})
                else:
                    self._commit(repo, revision, body)

            def _commit(self, repo: str, revision: str, body: bytes) -> None:
                lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                header = next(x["value"] for x in lines if x["key"] == "header")
                files = {
                    x["value"]["path"]: base64.b64decode(x["value"]["content"]) for x in lines if x["key"] == "file"
                }
                commit = Commit(repo, revision, header.get("summary", ""), files, time.time())
                with hub.lock:
                    index = len(hub.commits) + len(hub.failed)
                    delay = hub.delays[index] if index < len(hub.delays) else 0.0
                    fail = hub.failures[index] if index < len(hub.failures) else False
                if hub.on_commit is not None:
                    commit.note = hub.on_commit(commit)
                time.sleep(delay)
                if hub.on_commit is not None:
                    commit.note_after = hub.on_commit(commit)
                commit.finished = time.time()
                with hub.lock:
                    (hub.failed if fail else hub.commits).append(commit)
                if fail:
                    self._reply(403, {"error": "the stand-in refuses this commit"})
                else:
                    oid = f"{len(hub.commits):040x}"
                    self._reply(200, {"commitUrl": f"{hub.url}/{repo}/commit/{oid}", "commitOid": oid})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
