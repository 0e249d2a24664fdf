"""``layercut push``: dry-run lists, a real push against a local recording Hub, token hygiene.

The recording server answers the requests huggingface_hub 2.x makes for ``create_repo``,
``create_branch`` and ``upload_folder``, as the Hub does: validate-yaml for README.md;
preupload says "lfs" for ``*.safetensors`` and "regular" for the rest (inlined in the
commit NDJSON); then the large files go up by one of the two large-file transports, and
the commit references them by sha256:

- Xet (the default while ``hf_xet`` is installed, as it is with huggingface_hub 2.x): a
  write-token request to the Hub, then a xorb and a shard POSTed to the CAS URL the token
  names (served here too; newer routes such as xorb grants and v2 shards get a 404, as from
  an older CAS, and the client falls back). The xorb is decoded (chunk headers, LZ4 frames,
  byte grouping) and must equal the file byte for byte; the CAS must see only the Xet token.
- Git LFS (``HF_HUB_DISABLE_XET=1``): the LFS batch API, a PUT of each file's bytes to the
  storage URL it returns (compared byte for byte), and the verify call.

It listens on 127.0.0.1 only and shuts itself down after 120 s at most.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from layercut.compress.workflow.cli import main
from layercut.export.export import export_checkpoint

TOKEN = "hf_TestTokenDoNotLeak1234567890abcdef"
XET_TOKEN = "xet_TestCasToken0987654321"  # what the CAS must see instead of the Hub token
REPO = Path(__file__).resolve().parents[1]


def _lz4_block(src: bytes, out: bytearray) -> None:
    """Decode one LZ4 block (sequences of literals + back-references) onto ``out``."""
    i, n = 0, len(src)
    while i < n:
        token = src[i]
        i += 1
        lit = token >> 4
        if lit == 15:
            while True:
                lit += src[i]
                i += 1
                if src[i - 1] != 255:
                    break
        out += src[i : i + lit]
        i += lit
        if i >= n:  # the last sequence has literals only
            break
        offset = src[i] | src[i + 1] << 8
        i += 2
        length = token & 15
        if length == 15:
            while True:
                length += src[i]
                i += 1
                if src[i - 1] != 255:
                    break
        length += 4
        start = len(out) - offset
        if offset >= length:
            out += out[start : start + length]
        else:  # overlapping copy repeats the last `offset` bytes
            for k in range(length):
                out.append(out[start + k])


def _lz4_frame(data: bytes) -> bytes:
    """Decode an LZ4 frame (magic 0x184D2204, FLG/BD, blocks until a zero size)."""
    assert data[:4] == b"\x04\x22\x4d\x18", data[:4]
    flg = data[4]
    pos = 6 + (8 if flg & 0x08 else 0) + (4 if flg & 0x01 else 0) + 1  # content size, dict id, header checksum
    out = bytearray()
    while True:
        size = int.from_bytes(data[pos : pos + 4], "little")
        pos += 4
        if size == 0:
            return bytes(out)
        raw, size = bool(size & 0x80000000), size & 0x7FFFFFFF
        if raw:
            out += data[pos : pos + size]
        else:
            _lz4_block(data[pos : pos + size], out)
        pos += size + (4 if flg & 0x10 else 0)  # block checksum


def _ungroup4(grouped: bytes) -> bytes:
    """Invert Xet's byte grouping: 4 groups (sizes n//4, +1 for the first n % 4) interleaved back."""
    n = len(grouped)
    sizes = [n // 4 + (1 if g < n % 4 else 0) for g in range(4)]
    out, at = bytearray(n), 0
    for g, size in enumerate(sizes):
        out[g::4] = grouped[at : at + size]
        at += size
    return bytes(out)


def xorb_data(data: bytes) -> list[bytes]:
    """The decoded chunks of a serialized Xet xorb, in order.

    Each chunk: an 8-byte header (version u8, compressed size u24 LE, scheme u8, uncompressed
    size u24 LE) then the payload; scheme 0 = stored, 1 = LZ4, 2 = byte-grouping-4 + LZ4. The
    chunk list ends where the footer begins ("XETBLOB") or at the end of the body.
    """
    chunks, pos = [], 0
    while pos + 8 <= len(data) and data[pos : pos + 7] != b"XETBLOB":
        head = data[pos : pos + 8]
        size, scheme, raw = int.from_bytes(head[1:4], "little"), head[4], int.from_bytes(head[5:8], "little")
        payload = data[pos + 8 : pos + 8 + size]
        chunk = payload if scheme == 0 else _lz4_frame(payload) if scheme == 1 else _ungroup4(_lz4_frame(payload))
        assert scheme in (0, 1, 2) and len(chunk) == raw, (scheme, raw, len(chunk))
        chunks.append(chunk)
        pos += 8 + size
    return chunks


class _Hub(BaseHTTPRequestHandler):
    records: list[dict]

    def log_message(self, *args):  # keep the test output clean
        pass

    def _reply(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _record(self, method: str) -> tuple[dict, bytes, str]:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        path = self.path.split("?")[0]
        auth = self.headers.get("Authorization")
        rec = {"method": method, "path": path, "auth": auth, "auth_ok": auth == f"Bearer {TOKEN}"}
        self.server.records.append(rec)
        return rec, raw, f"http://127.0.0.1:{self.server.server_address[1]}"

    def do_POST(self):  # noqa: N802 (http.server's naming)
        rec, raw, base = self._record("POST")
        path = rec["path"]
        if path.startswith("/cas/"):  # Xet CAS: authorised by the short-lived Xet token only
            if rec["auth"] != f"Bearer {XET_TOKEN}":
                return self._reply(401, {"error": "bad xet token"})
            rec["body"] = raw
            if path.startswith("/cas/v1/xorbs/default/"):
                return self._reply(200, {"was_inserted": True})
            if path == "/cas/v1/shards":
                return self._reply(200, {"result": 1})
            return self._reply(404, {"error": f"unexpected {path}"})
        if path == "/lfs-verify":
            rec["json"] = json.loads(raw)
            return self._reply(200 if rec["auth_ok"] else 401, {})
        if not rec["auth_ok"]:
            return self._reply(401, {"error": "bad token"})
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
            mode = {f["path"]: "lfs" if f["path"].endswith(".safetensors") else "regular" for f in files}
            return self._reply(200, {"files": [{"path": p, "uploadMode": m, "shouldIgnore": False, "oid": None}
                                               for p, m in mode.items()]})
        if path.endswith(".git/info/lfs/objects/batch"):  # git LFS: where to PUT each object
            rec["json"] = body = json.loads(raw)
            return self._reply(200, {"transfer": "basic", "objects": [
                {"oid": o["oid"], "size": o["size"], "actions": {
                    "upload": {"href": f"{base}/lfs-storage/{o['oid']}"},
                    "verify": {"href": f"{base}/lfs-verify"}}} for o in body["objects"]]})
        if "/commit/" in path:
            lines = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
            rec["header"] = next(x["value"] for x in lines if x["key"] == "header")
            rec["commit_files"] = {x["value"]["path"]: base64.b64decode(x["value"]["content"])
                                   for x in lines if x["key"] == "file"}
            rec["lfs_files"] = {x["value"]["path"]: x["value"] for x in lines if x["key"] == "lfsFile"}
            return self._reply(200, {"commitUrl": f"{base}/org/model/commit/0123456789abcdef",
                                     "commitOid": "0123456789abcdef0123456789abcdef01234567"})
        return self._reply(404, {"error": f"unexpected {path}"})

    def do_PUT(self):  # noqa: N802
        rec, raw, _ = self._record("PUT")
        if rec["path"].startswith("/lfs-storage/"):
            rec["body"] = raw
            return self._reply(200, {})
        return self._reply(404, {"error": f"unexpected {rec['path']}"})

    def do_GET(self):  # noqa: N802
        rec, _, base = self._record("GET")
        if rec["path"].startswith("/api/models/") and "/xet-write-token/" in rec["path"] and rec["auth_ok"]:
            info = {"casUrl": f"{base}/cas", "accessToken": XET_TOKEN, "exp": int(time.time()) + 3600}
            return self._reply(200, info, {"X-Xet-Cas-Url": info["casUrl"], "X-Xet-Access-Token": XET_TOKEN,
                                           "X-Xet-Token-Expiration": str(info["exp"])})
        self._reply(404, {"error": "not recorded"})  # e.g. global dedup queries: nothing is known


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
    return subprocess.run([sys.executable, "-m", "layercut.cli", *args], capture_output=True, text=True,
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


@pytest.mark.parametrize("transport", ["xet", "lfs"])
def test_push_to_local_hub_records_exact_upload_and_never_leaks_token(exported, hub, tmp_path, transport):
    port = hub.server_address[1]
    env = _env(tmp_path, HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_TOKEN=TOKEN, HF_HUB_OFFLINE="0",
               **({"HF_HUB_DISABLE_XET": "1"} if transport == "lfs" else {}))
    dry = _cli(["push", str(exported), "--repo-id", "org/tiny", "--dry-run", "--json"], env, tmp_path)
    assert dry.returncode == 0, dry.stderr
    listed = json.loads(dry.stdout.strip().splitlines()[-1])["files"]

    res = _cli(["push", str(exported), "--repo-id", "org/tiny", "--private", "--revision", "v1", "--json"],
               env, tmp_path)
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert result["commit_url"].endswith("/commit/0123456789abcdef") and result["dry_run"] is False

    records = hub.records
    paths = [r["path"] for r in records]
    assert paths[0] == "/api/repos/create" and records[0]["json"]["visibility"] == "private"
    assert "/api/models/org/tiny/branch/v1" in paths
    validated = next(r for r in records if r["path"] == "/api/validate-yaml")
    assert validated["json"]["content"] == (exported / "README.md").read_text()

    # One commit: small files inline and byte-exact, large files by sha256 and size
    commits = [r for r in records if "/commit/" in r["path"]]
    assert len(commits) == 1 and commits[0]["path"] == "/api/models/org/tiny/commit/v1"
    commit = commits[0]
    large = sorted(f for f in listed if f.endswith(".safetensors"))
    assert large and sorted(commit["lfs_files"]) == large
    assert sorted([*commit["commit_files"], *commit["lfs_files"]]) == listed == result["files"]
    for name, content in commit["commit_files"].items():
        assert content == (exported / name).read_bytes(), name
    for name, entry in commit["lfs_files"].items():
        assert entry["algo"] == "sha256" and entry["oid"] == hashlib.sha256((exported / name).read_bytes()).hexdigest()

    hub_calls = [r for r in records if not r["path"].startswith(("/cas/", "/lfs-storage/"))]
    assert all(r["auth_ok"] for r in hub_calls), hub_calls
    if transport == "lfs":
        batch = next(r for r in records if r["path"] == "/org/tiny.git/info/lfs/objects/batch")
        assert batch["json"]["ref"] == {"name": "v1"}
        assert sorted(o["oid"] for o in batch["json"]["objects"]) == sorted(e["oid"] for e in commit["lfs_files"].values())
        puts = {r["path"].rsplit("/", 1)[1]: r for r in records if r["method"] == "PUT"}
        for name, entry in commit["lfs_files"].items():
            assert puts[entry["oid"]]["body"] == (exported / name).read_bytes(), name
            assert puts[entry["oid"]]["auth"] is None  # storage URLs never get the Hub token
        assert sorted(r["json"]["oid"] for r in records if r["path"] == "/lfs-verify") == sorted(puts)
        assert not [r for r in records if r["path"].startswith("/cas/")]
    else:
        token_calls = [r for r in records if r["method"] == "GET" and "/xet-write-token/" in r["path"]]
        assert token_calls and all(r["path"] == "/api/models/org/tiny/xet-write-token/v1" for r in token_calls)
        cas = [r for r in records if r["path"].startswith("/cas/")]
        assert cas and all(r["auth"] == f"Bearer {XET_TOKEN}" for r in cas)  # never the Hub token
        xorbs = [r for r in cas if r["path"].startswith("/cas/v1/xorbs/default/")]
        shards = [r for r in cas if r["path"] == "/cas/v1/shards" and r["method"] == "POST"]
        assert xorbs and shards
        assert len(large) == 1 and len(xorbs) == 1  # one small safetensors file: one xorb holds it all
        assert b"".join(xorb_data(xorbs[0]["body"])) == (exported / large[0]).read_bytes()
        assert not [r for r in records if r["method"] == "PUT"]
    unexpected = [r for r in records if r["method"] == "GET" and "/xet-write-token/" not in r["path"]
                  and not r["path"].startswith("/cas/v1/chunks/")]
    assert not unexpected, unexpected

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


def test_pushed_card_loads_the_repo_id_not_the_local_folder(hub, tmp_path, tiny_model_dir):
    """A layercut card's usage snippet names the local folder; what the Hub receives names the repo."""
    from layercut.export.card import write_card

    folder = tmp_path / "release"
    export_checkpoint(tiny_model_dir("llama"), folder)
    report = {"layercut_run": 1, "model": "tiny", "stages": [{"stage": "prune", "dir": "01-prune", "report": {}}]}
    local = write_card(folder, report, tiny_model_dir("llama")).read_text()
    assert f'from_pretrained("{folder.resolve()}")' in local
    env = _env(tmp_path, HF_ENDPOINT=f"http://127.0.0.1:{hub.server_address[1]}", HF_TOKEN=TOKEN, HF_HUB_OFFLINE="0")
    dry = _cli(["push", str(folder), "--repo-id", "org/tiny", "--revision", "v1", "--dry-run", "--json"], env, tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout.strip().splitlines()[-1])["card"] == "README.md: usage snippet set to load org/tiny"
    res = _cli(["push", str(folder), "--repo-id", "org/tiny", "--revision", "v1", "--json"], env, tmp_path)
    assert res.returncode == 0, res.stderr

    commit = next(r for r in hub.records if "/commit/" in r["path"])
    pushed = commit["commit_files"]["README.md"].decode()
    validated = next(r for r in hub.records if r["path"] == "/api/validate-yaml")
    assert validated["json"]["content"] == pushed  # the Hub validates the card it stores
    assert 'from_pretrained("org/tiny", revision="v1")' in pushed and str(folder.resolve()) not in pushed
    assert pushed.replace('"org/tiny", revision="v1"', json.dumps(str(folder.resolve()))) == local  # nothing else
    assert (folder / "README.md").read_text() == local  # the local card is left as it was
    for name, content in commit["commit_files"].items():
        if name != "README.md":
            assert content == (folder / name).read_bytes(), name
