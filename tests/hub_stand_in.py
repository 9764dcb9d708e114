"""A local stand-in for the Hugging Face Hub HTTP API, on 127.0.0.1, for offline tests.

Enough of the API for `HfApi.create_repo`/`upload_folder` (the single-commit path with
HF_HUB_DISABLE_XET=1, files sent as base64 "regular" blobs) and for downloads by `hf_hub_download`
and `from_pretrained` (HEAD/GET on /{repo}/resolve/{rev}/{file}, model info). Repositories live in memory.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

from helpers import WORKERS, run_script


class HubStandIn:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.commits: list[dict] = []
        #: (repo, revision, file, Authorization header) of every download asked for, and of every revision looked up
        #: (file None): huggingface_hub resolves a branch or tag to a commit first, then downloads at that commit (the
        #: stand-in serves the latest files at any revision)
        self.downloads: list[tuple[str, str, str | None, str | None]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _reply(self, code, body=b"", headers=None, content_type="application/json"):
                if isinstance(body, (dict, list)):
                    body = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _body(self):
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _file(self):
                parts = unquote(urlparse(self.path).path).strip("/").split("/")
                # {ns}/{name}/resolve/{rev}/{path...}
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo = f"{parts[0]}/{parts[1]}"
                    filename = "/".join(parts[4:])
                    hub.downloads.append((repo, parts[3], filename, self.headers.get("Authorization")))
                    return repo, filename
                return None, None

            def do_HEAD(self):
                self._get_or_head()

            def do_GET(self):
                self._get_or_head()

            def _get_or_head(self):
                path = urlparse(self.path).path
                if path.startswith("/api/whoami-v2"):
                    return self._reply(200, {"type": "user", "name": "offline-user",
                                             "auth": {"accessToken": {"role": "write"}}})
                if path.startswith("/api/models/"):
                    parts = path.split("/")  # ['', 'api', 'models', ns, name, ...]
                    repo = f"{parts[3]}/{parts[4]}"
                    if repo not in hub.repos:
                        return self._reply(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                    files = hub.repos[repo]
                    if len(parts) > 6 and parts[5] == "revision":
                        hub.downloads.append((repo, unquote(parts[6]), None, self.headers.get("Authorization")))
                    if len(parts) > 5 and parts[5] == "tree":
                        return self._reply(200,
                                           [{"type": "file", "path": f, "size": len(b), "oid": _sha(b)}
                                            for f, b in files.items()])
                    return self._reply(200, {"id": repo, "modelId": repo, "sha": hub.head(repo), "private": False,
                                             "siblings": [{"rfilename": f} for f in sorted(files)]})
                repo, filename = self._file()
                if repo is None:
                    return self._reply(404, {"error": f"stand-in: unhandled {self.command} {path}"})
                if repo not in hub.repos:
                    return self._reply(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                if filename not in hub.repos[repo]:
                    return self._reply(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound",
                                                                         "X-Repo-Commit": hub.head(repo)})
                data = hub.repos[repo][filename]
                self._reply(200, data, {"X-Repo-Commit": hub.head(repo), "ETag": f'"{_sha(data)}"'},
                            content_type="application/octet-stream")

            def do_POST(self):
                body = self._body()
                path = urlparse(self.path).path
                if path == "/api/repos/create":
                    req = json.loads(body)
                    repo = f"{req.get('organization') or 'offline-user'}/{req['name']}"
                    hub.repos.setdefault(repo, {})
                    return self._reply(200, {"url": f"{hub.endpoint}/{repo}", "name": repo, "id": repo})
                if path == "/api/validate-yaml":
                    return self._reply(200, {"errors": [], "warnings": []})
                parts = path.split("/")
                if len(parts) >= 7 and parts[5] == "preupload":
                    files = json.loads(body)["files"]
                    return self._reply(200,
                                       {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                       for f in files]})
                if len(parts) >= 7 and parts[5] == "commit":
                    repo = f"{parts[3]}/{parts[4]}"
                    lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                    header = next(line["value"] for line in lines if line["key"] == "header")
                    files = {line["value"]["path"]: base64.b64decode(line["value"]["content"])
                             for line in lines if line["key"] == "file"}
                    hub.repos.setdefault(repo, {}).update(files)
                    for line in lines:
                        if line["key"] == "deletedFile":
                            hub.repos[repo].pop(line["value"]["path"], None)
                    oid = hashlib.sha1(body).hexdigest()
                    hub.commits.append({"repo": repo, "summary": header.get("summary"), "files": sorted(files),
                                        "oid": oid})
                    return self._reply(200, {"commitUrl": f"{hub.endpoint}/{repo}/commit/{oid}", "commitOid": oid,
                                             "pullRequestUrl": None})
                self._reply(404, {"error": f"stand-in: unhandled POST {path}"})

        return Handler

    def head(self, repo: str) -> str:
        oids = [c["oid"] for c in self.commits if c["repo"] == repo]
        return oids[-1] if oids else "0" * 40


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def run_hub_worker(worker: str, out: Path) -> tuple[HubStandIn, dict]:
    """Run tests/workers/`worker` (a script taking the output folder) against a fresh stand-in Hub, offline from the
    real one; returns the Hub (closed, its repos and downloads kept) and the worker's results.json."""
    hub = HubStandIn()
    try:
        run_script(WORKERS / worker, str(out), launcher="python", nproc=1, timeout=600, env={
            "HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": "hf_offline_dummy_token",
            "HF_HOME": str(out / "hf_home"), "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": None})
    finally:
        hub.close()
    return hub, json.loads((out / "results.json").read_text())
