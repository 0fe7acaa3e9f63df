"""A Hugging Face Hub on 127.0.0.1 for the publishing tests: the endpoints ``huggingface_hub``'s own client calls to
create a model repo, read its info and commit small files (``HF_ENDPOINT`` points the client at it), answered the way
the Hub answers them, with what each request carried kept for the test to read.

Nothing is mocked on the client side: our code calls ``HfApi`` as it would against huggingface.co, and the files a
commit carries are the bytes ``huggingface_hub`` read from disk and sent (every file is declared a regular git blob,
so its content travels base64-encoded inside the commit request).
"""

from __future__ import annotations

import base64
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_REPO = r"(?P<repo>[^/]+/[^/?]+)"


@dataclass
class Repo:
    private: bool
    created_with: dict[str, Any]  # the body of the create request
    files: dict[str, bytes] = field(default_factory=dict)
    commits: list[str] = field(default_factory=list)  # commit messages


class FakeHub:
    """``with FakeHub() as hub:`` serves on ``hub.endpoint`` until the block ends; ``hub.repos`` holds what was
    created and committed."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length", 0)))

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                match = re.fullmatch(rf"/api/models/{_REPO}(/revision/[^?]*)?(\?.*)?", self.path)
                if match is None or match["repo"] not in hub.repos:
                    return self._answer(404, {"error": "Repository not found"})
                repo = hub.repos[match["repo"]]
                return self._answer(200, {"id": match["repo"], "private": repo.private, "sha": "0" * 40,
                                          "siblings": [{"rfilename": name} for name in repo.files]})

            def do_POST(self) -> None:  # noqa: N802
                body = self._body()
                if self.path == "/api/repos/create":
                    request = json.loads(body)
                    repo_id = f"{request['organization']}/{request['name']}"
                    if repo_id in hub.repos:
                        return self._answer(409, {"error": "You already created this model repo",
                                                  "url": f"{hub.endpoint}/{repo_id}"})
                    hub.repos[repo_id] = Repo(request.get("visibility") == "private", request)
                    return self._answer(200, {"url": f"{hub.endpoint}/{repo_id}"})
                if self.path == "/api/validate-yaml":
                    return self._answer(200, {})
                if match := re.fullmatch(rf"/api/models/{_REPO}/preupload/[^?]+(\?.*)?", self.path):
                    files = json.loads(body)["files"]
                    return self._answer(200, {"files": [{"path": entry["path"], "uploadMode": "regular",
                                                         "shouldIgnore": False} for entry in files]})
                if match := re.fullmatch(rf"/api/models/{_REPO}/commit/[^?]+(\?.*)?", self.path):
                    repo = hub.repos[match["repo"]]
                    for line in body.decode().splitlines():
                        item = json.loads(line)
                        if item["key"] == "header":
                            repo.commits.append(item["value"]["summary"])
                        elif item["key"] == "file":
                            repo.files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                    oid = f"{len(repo.commits):040x}"
                    return self._answer(200, {"commitUrl": f"{hub.endpoint}/{match['repo']}/commit/{oid}",
                                              "commitOid": oid})
                return self._answer(404, {"error": f"not served here: POST {self.path}"})

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def env(self) -> dict[str, str]:
        """The environment that sends huggingface_hub here, online, with a token."""
        return {"HF_ENDPOINT": self.endpoint, "HF_TOKEN": "hf_fake_token_for_the_local_hub",
                "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1"}
