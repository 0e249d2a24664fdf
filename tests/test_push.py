"""``layercut push``: dry-run lists, a real push against a local recording Hub, token hygiene.

The recording server answers the requests huggingface_hub 2.x makes for ``create_repo``,
``create_branch`` and ``upload_folder`` (validate-yaml for README.md; preupload: every
file "regular", so content is inlined in the commit NDJSON, no Xet/LFS; then the commit)
and records them. It listens
on 127.0.0.1 only and shuts itself down after 120 s at most.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from compress.cli import main
from export.export import export_checkpoint

TOKEN = "hf_TestTokenDoNotLeak1234567890abcdef"
REPO = Path(__file__).resolve().parents[1]


class _Hub(BaseHTTPRequestHandler):
    records: list[dict]

    def log_message(self, *args):  # keep the test output clean
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):  # noqa: N802 (http.server's naming)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        path = self.path.split("?")[0]
        rec = {"method": "POST", "path": path, "auth_ok": self.headers.get("Authorization") == f"Bearer {TOKEN}"}
        self.server.records.append(rec)
        if not rec["auth_ok"]:
            return self._reply(401, {"error": "bad token"})
        base = f"http://127.0.0.1:{self.server.server_address[1]}"
        if path == "/api/repos/create":
            rec["json"] = json.loads(raw)
            return self._reply(200, {"url": f"{base}/{rec['json']['organization']}/{rec['json']['name']}"})
        if path == "/api/validate-yaml":  # upload_folder validates README.md's front matter first
            rec["json"] = json.loads(raw)
            return self._reply(200, {"errors": [], "warnings": []})
        if "/branch/" in path:
            return self._reply(200, {})
        if "/preupload/" in path:
            files = json.loads(raw)["files"]
            rec["files"] = [f["path"] for f in files]
            return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                                                "oid": None} for f in files]})
        if "/commit/" in path:
            lines = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
            rec["header"] = next(x["value"] for x in lines if x["key"] == "header")
            rec["commit_files"] = {x["value"]["path"]: base64.b64decode(x["value"]["content"])
                                   for x in lines if x["key"] == "file"}
            return self._reply(200, {"commitUrl": f"{base}/org/model/commit/0123456789abcdef",
                                     "commitOid": "0123456789abcdef0123456789abcdef01234567"})
        return self._reply(404, {"error": f"unexpected {path}"})

    def do_GET(self):  # noqa: N802
        self.server.records.append({"method": "GET", "path": self.path})
        self._reply(404, {"error": "not recorded"})


@pytest.fixture()
def hub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    server.records = []
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    stopper = threading.Timer(120, server.shutdown)  # bounded: never outlives a hung test
    stopper.start()
    try:
        yield server
    finally:
        stopper.cancel()
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("push") / "release"
    export_checkpoint(tiny_model_dir("llama"), out, extra_files={"README.md": "---\nlicense: mit\n---\n# tiny\n"})
    (out / ".hidden").write_text("never uploaded")
    return out


def _cli(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "compress.cli", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


def _env(tmp_path: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1", PYTHONPATH=str(REPO),
               HF_HUB_DISABLE_PROGRESS_BARS="1", **extra)
    return env


def test_dry_run_lists_exact_files(exported, capsys):
    assert main(["push", str(exported), "--repo-id", "org/tiny", "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected = sorted(p.name for p in exported.iterdir() if p.is_file() and not p.name.startswith("."))
    assert plan["files"] == expected and plan["dry_run"] is True
    assert "model.safetensors.index.json" in plan["files"] and ".hidden" not in plan["files"]
    assert plan["bytes"] == sum((exported / f).stat().st_size for f in expected)


def test_push_to_local_hub_records_exact_upload_and_never_leaks_token(exported, hub, tmp_path):
    port = hub.server_address[1]
    env = _env(tmp_path, HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_TOKEN=TOKEN, HF_HUB_OFFLINE="0")
    dry = _cli(["push", str(exported), "--repo-id", "org/tiny", "--dry-run", "--json"], env, tmp_path)
    assert dry.returncode == 0, dry.stderr
    listed = json.loads(dry.stdout.strip().splitlines()[-1])["files"]

    res = _cli(["push", str(exported), "--repo-id", "org/tiny", "--private", "--revision", "v1", "--json"],
               env, tmp_path)
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert result["commit_url"].endswith("/commit/0123456789abcdef") and result["dry_run"] is False

    paths = [r["path"] for r in hub.records]
    assert paths[0] == "/api/repos/create" and hub.records[0]["json"]["visibility"] == "private"
    assert "/api/models/org/tiny/branch/v1" in paths
    assert all(r.get("auth_ok") for r in hub.records), hub.records
    commit = next(r for r in hub.records if "/commit/" in r["path"])
    assert commit["path"] == "/api/models/org/tiny/commit/v1"
    assert sorted(commit["commit_files"]) == listed == result["files"]
    for name, content in commit["commit_files"].items():
        assert content == (exported / name).read_bytes(), name
    assert not [r for r in hub.records if r["method"] == "GET"], "unexpected GET requests"
    validated = next(r for r in hub.records if r["path"] == "/api/validate-yaml")
    assert validated["json"]["content"] == (exported / "README.md").read_text()
    assert len(paths) == 5, paths  # create, branch, validate-yaml, preupload, commit: nothing else

    # The token never appears in output, and nothing under the test dirs stores it.
    assert TOKEN not in res.stdout + res.stderr + dry.stdout + dry.stderr
    for root in (tmp_path, exported):
        for f in root.rglob("*"):
            if f.is_file():
                assert TOKEN.encode() not in f.read_bytes(), f


def test_server_error_is_one_line_without_token(exported, hub, tmp_path):
    env = _env(tmp_path, HF_ENDPOINT=f"http://127.0.0.1:{hub.server_address[1]}", HF_TOKEN=TOKEN + "x",
               HF_HUB_OFFLINE="0")
    res = _cli(["push", str(exported), "--repo-id", "org/tiny"], env, tmp_path)
    assert res.returncode == 2
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert lines[-1].startswith("error: push to org/tiny failed:") and TOKEN not in res.stderr + res.stdout
    assert [x for x in lines if x.startswith("error:")] == [lines[-1]]


def test_missing_token_is_a_clean_error(exported, tmp_path):
    res = _cli(["push", str(exported), "--repo-id", "org/tiny"], _env(tmp_path, HF_HUB_OFFLINE="0"), tmp_path)
    assert res.returncode == 2
    assert [x for x in res.stderr.splitlines() if x.strip()] == [
        "error: no Hugging Face token found: set HF_TOKEN or run `hf auth login` (or use --dry-run)"]


@pytest.mark.parametrize("bad", ["tiny", "org/ti ny", "org/a--b", "a/b/c", "-org/x", "org/" + "x" * 97, "org/x.git"])
def test_invalid_repo_id(exported, bad, capsys):
    assert main(["push", str(exported), f"--repo-id={bad}", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: invalid repo id '{bad}'") and err.count("\n") == 1


def test_dry_run_of_a_run_directory_pushes_its_final_model(exported, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(exported, run / "03-export" / "model")
    (run / "recipe.yaml").write_text("version: 1\n")
    (run / "report.json").write_text(json.dumps({"final_model": "03-export/model", "stages": []}))
    assert main(["push", str(run), "--repo-id", "org/tiny", "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["folder"] == str(run / "03-export" / "model")
    assert plan["files"] == sorted(p.name for p in exported.iterdir() if not p.name.startswith("."))
