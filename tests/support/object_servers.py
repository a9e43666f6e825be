"""Object-store protocol servers for the tests, on 127.0.0.1: moto's S3 server, the GCS
emulator from PyPI, and a small HTTP proxy in front of one that injects faults (503s, dropped
connections, or 403 for every request)."""

from __future__ import annotations

import http.client
import http.server
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REGION = "us-east-1"
SECRET = "Zq7secretsecretvalue"  # AWS_SECRET_ACCESS_KEY: must appear in no message
KEY_ID = "AKIDTESTKEY123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log() -> tempfile._TemporaryFileWrapper:
    """Where a server's request log goes: a file, never a pipe nobody reads (a full pipe
    blocks the server's request threads)."""
    return tempfile.NamedTemporaryFile("w+", prefix="eb-server-", suffix=".log")


def _wait(url: str, proc: subprocess.Popen, what: str, log) -> None:
    for _ in range(200):
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{what} exited: {log.read()[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except OSError as e:
            if getattr(e, "code", None):  # an HTTP error: the server answers
                return
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not start")


def s3_env() -> dict:
    return {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_REGION": REGION}


class S3Server:
    def __init__(self):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = _log()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=self.log,
        )  # fmt: skip
        _wait(self.endpoint + "/", self.proc, "moto", self.log)
        import boto3

        self.client = boto3.client(
            "s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=KEY_ID,
            aws_secret_access_key=SECRET,
        )  # fmt: skip

    def bucket(self, name: str) -> str:
        self.client.create_bucket(Bucket=name)
        return name

    def upload(self, local: Path, bucket: str, key: str) -> None:
        self.client.upload_file(str(local), bucket, key)

    def keys(self, bucket: str, prefix: str) -> dict[str, int]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return {o["Key"]: o["Size"] for p in pages for o in p.get("Contents", [])}

    def get(self, bucket: str, key: str) -> bytes:
        return self.client.get_object(Bucket=bucket, Key=key)["Body"].read()

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=bucket, Key=key, Body=data)

    def table(self, bucket: str, prefix: str) -> pa.Table:
        """Every visible part under `prefix`, as one table (each must be readable)."""
        keys = self.keys(bucket, prefix)
        parts = [k for k in keys if k.rsplit("/", 1)[-1].startswith("part-")]
        return pa.concat_tables([pq.read_table(io.BytesIO(self.get(bucket, k))) for k in parts])

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()


class GcsServer:
    def __init__(self, data_dir: Path):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = _log()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
             "--port", str(self.port), "--in-memory"],
            stdout=self.log, stderr=self.log, cwd=data_dir,
        )  # fmt: skip
        _wait(self.endpoint + "/", self.proc, "gcp-storage-emulator", self.log)

    def bucket(self, name: str) -> str:
        body = json.dumps({"name": name}).encode()
        req = urllib.request.Request(f"{self.endpoint}/storage/v1/b?project=test", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        urllib.request.urlopen(req, timeout=10)
        return name

    def upload(self, local: Path, bucket: str, key: str) -> None:
        req = urllib.request.Request(f"{self.endpoint}/{bucket}/{key}", data=local.read_bytes(),
                                     method="PUT")  # fmt: skip
        urllib.request.urlopen(req, timeout=30)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()


class FaultProxy:
    """Forwards HTTP requests to `upstream` (`delay_s` before each PUT); `fail_every` k: every
    k-th request gets a 503 (SlowDown) and every (k+2)-th connection is dropped before any
    answer; `deny`: every request gets a 403 (AccessDenied)."""

    def __init__(self, upstream: str, fail_every: int = 0, deny: bool = False, translate=None,
                 delay_s: float = 0.0):  # fmt: skip
        self.upstream = upstream.removeprefix("http://")
        self.translate = translate  # (method, path) -> (status, body) | None: answered here
        self.delay_s = delay_s  # before each PUT: a slow store, so runs can be caught mid-way
        self.fail_every, self.deny = fail_every, deny
        self.count = 0
        self.injected = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy.lock:
                    proxy.count += 1
                    n = proxy.count
                if proxy.deny:
                    return self._answer(403, b"<?xml version=\"1.0\"?><Error><Code>AccessDenied"
                                             b"</Code></Error>")  # fmt: skip
                k = proxy.fail_every
                if k and n % k == 0:
                    proxy.injected += 1
                    return self._answer(503, b"<?xml version=\"1.0\"?><Error><Code>SlowDown"
                                             b"</Code></Error>")  # fmt: skip
                if k and n % (k + 2) == 0:
                    proxy.injected += 1
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return None
                if proxy.delay_s and self.command == "PUT":
                    time.sleep(proxy.delay_s)
                if proxy.translate and (got := proxy.translate(self.command, self.path)):
                    return self._answer(*got)
                conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                r = conn.getresponse()
                data = r.read()
                self.send_response(r.status)
                head = self.command == "HEAD"  # keeps the object's Content-Length
                skip = ("transfer-encoding", "connection") + (() if head else ("content-length",))
                for h, v in r.getheaders():
                    if h.lower() not in skip:
                        self.send_header(h, v)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                names = {h.lower() for h, _ in r.getheaders()}
                if proxy.translate and "last-modified" not in names:  # the GCS emulator's GET
                    self.send_header("Last-Modified", "Mon, 01 Jan 2024 00:00:00 GMT")
                if proxy.translate and "etag" not in names:
                    self.send_header("ETag", '"emulator"')
                self.end_headers()
                self.wfile.write(data)

            def _answer(self, status: int, data: bytes, headers: dict | None = None):
                self.send_response(status)
                headers = headers or {"Content-Length": str(len(data))}
                for h, v in headers.items():
                    self.send_header(h, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()


def gcs_xml_shim(upstream: str):
    """The two XML-API requests of the object_store crate the GCS emulator lacks (listing a
    prefix, deleting an object), answered through its JSON API."""
    import datetime
    import email.utils
    import urllib.error
    import urllib.parse
    from xml.sax.saxutils import escape

    def translate(method: str, path: str):
        url = urllib.parse.urlsplit(path)
        q = urllib.parse.parse_qs(url.query)
        bucket, _, key = url.path.lstrip("/").partition("/")
        if method == "GET" and not key and "list-type" in q:
            prefix = q.get("prefix", [""])[0]
            api = f"{upstream}/storage/v1/b/{bucket}/o?prefix={urllib.parse.quote(prefix)}"
            items = json.load(urllib.request.urlopen(api, timeout=30)).get("items", [])
            rows = "".join(
                f"<Contents><Key>{escape(i['name'])}</Key><Size>{i['size']}</Size>"
                f"<LastModified>{i['updated']}</LastModified><ETag>{i.get('etag', '')}</ETag>"
                f"</Contents>" for i in items)  # fmt: skip
            return 200, (f"<?xml version='1.0' encoding='UTF-8'?><ListBucketResult>"
                         f"<IsTruncated>false</IsTruncated>{rows}</ListBucketResult>").encode()
        if method == "HEAD" and key:
            name = urllib.parse.quote(urllib.parse.unquote(key), safe="")
            try:
                meta = json.load(urllib.request.urlopen(
                    f"{upstream}/storage/v1/b/{bucket}/o/{name}", timeout=30))  # fmt: skip
            except urllib.error.HTTPError as e:
                return e.code, b"", {"Content-Length": "0"}
            updated = email.utils.format_datetime(
                datetime.datetime.fromisoformat(meta["updated"].replace("Z", "+00:00")), True)
            return 200, b"", {"Content-Length": str(meta["size"]), "Last-Modified": updated,
                              "ETag": f'"{meta.get("etag", "x")}"'}  # fmt: skip
        if method == "DELETE" and key:
            name = urllib.parse.quote(urllib.parse.unquote(key), safe="")
            api = f"{upstream}/storage/v1/b/{bucket}/o/{name}"
            try:
                urllib.request.urlopen(urllib.request.Request(api, method="DELETE"), timeout=30)
            except urllib.error.HTTPError as e:
                return e.code, b""
            return 204, b""
        return None

    return translate


def eaglebatch_env(extra: dict | None = None) -> dict:
    """os.environ for an eaglebatch subprocess with the S3 test credentials."""
    return {**os.environ, **s3_env(), **(extra or {})}
