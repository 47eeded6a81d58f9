"""An optional HTTP front-end for a live run's task queue: requests over HTTP become request files.

A running ``lorafleet train`` watches a queue directory of request files (one request a file, YAML or
JSON, names ending ``.yaml``/``.yml``/``.json``; names starting with ``.`` are ignored). This server
is a second way to put files there, nothing more: it checks a request's shape only, writes it as a
request file (a ``.``-named temp file in the queue, then ``os.replace`` to
``<UTC timestamp YYYYmmddTHHMMSSffffff>-<name>.json``), and reads back what the watcher did. The
watcher stays the one path of truth: it validates, applies at step boundaries, and moves each file to
``accepted/`` or ``rejected/`` (the reason in ``rejected/<file>.reason``).

:func:`start_queue_server` binds 127.0.0.1 only (never another interface) and writes the address and
a fresh bearer token to ``<queue_dir>/.http.json`` (``{"url": ..., "token": ...}``, mode 0600; the
leading dot keeps the watcher off it); :meth:`QueueServer.close` removes it. The launcher binds first
(:func:`bind_queue_server`: a port in use is an InputError before the run directory is claimed) and
serves once the run is its (:meth:`QueueServer.serve`); a token file a killed run left is removed when
the next run claims the queue (:func:`remove_stale_token`). Every request needs
``Authorization: Bearer <token>`` (else 401). JSON in and out:

    POST   /v1/tasks                           a request object (an add: the task, with optional
                                               "at_step", "share", "deadline")        -> 202
    DELETE /v1/tasks/<name>?mode=finish|cancel stop a task (default cancel)            -> 202
    PATCH  /v1/tasks/<name>                    {"share", "deadline", "eval": {"every_steps"},
                                               "early_stopping"}, one at least          -> 202
    GET    /v1/tasks                           {"ledger": <run_dir/tasks.json or null>, "pending": [...],
                                               "rejected": [{"file", "reason"}], "accepted": [...]} -> 200
    GET    /v1/tasks/<name>                    {"name", "ledger": its entry, "evaluations": its evaluations
                                               (history [[step, loss, accuracy], ...], stopping, stopped_at)}
                                                                                       -> 200
    GET    /v1/fleet                           the live page's data (``fleet_view.FleetView``): the run, each
                                               tenant's state, progress, ETA, curves and GPU-seconds, the
                                               replicas and their utilisation, the queue     -> 200

**The live page.** ``GET /`` answers the page (``static/index.html``, with ``fleet.js`` and ``fleet.css``): static
files shipped in the package, the same for every run, so they are served without the token; they hold nothing of
the run. The page takes the token from its URL's fragment (``/#token=<token>``: a fragment never leaves the
browser, so it is in no request line or log) and polls ``GET /v1/fleet`` with it, which, as every other endpoint,
answers 401 without it. Its answers say ``Cache-Control: no-store``, and the page's a ``Content-Security-Policy``
that lets it load its own files and connect to this server only.

A 202 answers ``{"file": <basename>, "status": "queued"}``. Errors answer ``{"error": <one line>}``:
400 bad JSON (parsed as a request file is, ``requests.parse_request``: nested at most 32 deep, numbers
finite) or shape, 401 no or wrong token, 404 anything else, 411 no ``Content-Length`` on a POST/PATCH,
413 a body over 1 MiB (``requests.MAX_REQUEST_BYTES``), 500 a failure of the server's own, which the
answer does not describe (the run's log has its one line). Nothing else is logged per request. Up to
:data:`BACKLOG` connections wait to be accepted, so a burst of clients is answered, not reset.
"""

from __future__ import annotations

import functools
import hmac
import json
import secrets
import sys
import threading
from collections.abc import Mapping
from dataclasses import asdict
from datetime import datetime, timezone
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.resources import files
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from lorafleet.errors import InputError
from lorafleet.rundir import EVALUATIONS, HTTP_TOKEN, LEDGER, RunDir
from lorafleet.specs.io import write_text_atomic
from lorafleet.specs.names import task_name_error
from lorafleet.train.queue.fleet_view import FleetWatch, queue_view
from lorafleet.train.queue.requests import (
    ACCEPTED,
    MAX_REQUEST_BYTES,
    REJECTED,
    UPDATE_KEYS,
    Action,
    MalformedRequest,
    parse_request,
)

HOST = "127.0.0.1"
MAX_BODY = MAX_REQUEST_BYTES
"""The largest body read: a request file's bound."""
BACKLOG = 128
"""Connections the listening socket holds until they are accepted (``request_queue_size``; the base class's 5
reset most of a burst of 120 clients)."""
PRIVATE = 0o600
"""The mode of the files the server writes: the token file and the request files."""
PRIVATE_DIR = 0o700
"""The mode of the queue directory when the run creates it."""
_STOPS = (Action.FINISH, Action.CANCEL)
_TASKS = "/v1/tasks"
_FLEET = "/v1/fleet"
_PAGE = {"/": "index.html", "/index.html": "index.html", "/fleet.js": "fleet.js", "/fleet.css": "fleet.css"}
"""The live page's files (``static/``), by the path they are served at."""
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
_PAGE_POLICY = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'"
_POLL_S = 0.05  # how often the serving thread looks for close(): close() waits up to this long


class _HttpError(Exception):
    """A request answered with ``status`` and ``{"error": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = " ".join(message.split())


class _Server(ThreadingHTTPServer):
    """The HTTP server, carrying the queue, the run directory and the token its handlers need."""

    daemon_threads = True
    request_queue_size = BACKLOG

    def __init__(self, port: int, token: str) -> None:
        super().__init__((HOST, port), _Handler)
        self.queue_dir = Path()
        """The queue it serves (set by :meth:`QueueServer.serve`)."""
        self.run_dir = Path()
        self.fleet: FleetWatch | None = None
        """What ``GET /v1/fleet`` answers (set by :meth:`QueueServer.serve`)."""
        self.token = token
        self.write_lock = threading.Lock()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Silent: a client that hangs up mid-request is not worth a traceback on stderr."""


class _Handler(BaseHTTPRequestHandler):
    """One request: authenticate, route, answer JSON; never raises, never logs."""

    server: _Server
    server_version = "lorafleet-queue"
    sys_version = ""
    timeout = 10.0

    def log_message(self, format: str, *args: Any) -> None:
        """Silent: no line on stderr per request."""

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def do_DELETE(self) -> None:
        self._handle()

    def do_PATCH(self) -> None:
        self._handle()

    def do_PUT(self) -> None:
        self._handle()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The base class's own errors (a malformed request line, an unknown method) as JSON too, with a
        status line even where the request line was never parsed (the base class would answer HTTP/0.9)."""
        self.close_connection = True
        if getattr(self, "request_version", "HTTP/0.9") == "HTTP/0.9":
            self.request_version = "HTTP/1.0"
        self._reply(code, {"error": message or HTTPStatus(code).phrase})

    def _handle(self) -> None:
        self.close_connection = True
        if self.command == "GET" and urlsplit(self.path).path in _PAGE:
            self._drain()
            self._static(_PAGE[urlsplit(self.path).path])
            return
        try:
            if not self._authorized():
                self._drain()
                raise _HttpError(401, "missing or wrong bearer token")
            status, payload = self._route()
        except _HttpError as exc:
            status, payload = exc.status, {"error": exc.message}
        except Exception as exc:  # a bad request must never take the server down, nor read its internals
            status, payload = 500, {"error": _internal(self.command)}
            what = " ".join(f"{type(exc).__name__}: {exc}".split())
            print(
                f"lorafleet train: queue: HTTP {self.command} {self.path} failed: {what}", file=sys.stderr, flush=True
            )
        self._reply(status, payload)

    def _authorized(self) -> bool:
        scheme, _, given = (self.headers.get("Authorization") or "").strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(given.strip().encode(), self.server.token.encode())

    def _route(self) -> tuple[int, dict[str, Any]]:
        url = urlsplit(self.path)
        path = url.path.rstrip("/") or "/"
        method = self.command
        if path == _TASKS and method == "GET":
            self._drain()
            return 200, _listing(self.server.queue_dir, self.server.run_dir)
        if path == _FLEET and method == "GET" and self.server.fleet is not None:
            self._drain()
            return 200, self.server.fleet.view().to_json()
        if path == _TASKS and method == "POST":
            body = _check_request(self._json_body())
            return 202, self._queue(body)
        if path.startswith(_TASKS + "/") and method == "GET":
            self._drain()
            return 200, _task_view(_check_name(unquote(path[len(_TASKS) + 1 :])), self.server.run_dir)
        if path.startswith(_TASKS + "/") and method in ("DELETE", "PATCH"):
            name = _check_name(unquote(path[len(_TASKS) + 1 :]))
            if method == "DELETE":
                self._drain()
                return 202, self._queue({"action": _mode(url.query), "name": name})
            return 202, self._queue({"action": Action.UPDATE.value, "name": name, **_check_update(self._json_body())})
        self._drain()
        raise _HttpError(404, f"no such endpoint: {method} {url.path}")

    def _queue(self, request: dict[str, Any]) -> dict[str, Any]:
        with self.server.write_lock:
            target = _request_path(self.server.queue_dir, request["name"])
            write_text_atomic(target, json.dumps(request, indent=2, allow_nan=False) + "\n", mode=PRIVATE)
        return {"file": target.name, "status": "queued"}

    def _content_length(self) -> int | None:
        raw = self.headers.get("Content-Length")
        if raw is None:
            return None
        try:
            length = int(raw)
        except ValueError:
            raise _HttpError(400, f"bad Content-Length: {raw!r}") from None
        if length < 0:
            raise _HttpError(400, f"bad Content-Length: {raw!r}")
        return length

    def _json_body(self) -> Any:
        length = self._content_length()
        if length is None:
            raise _HttpError(411, "Content-Length required")
        if length > MAX_BODY:
            raise _HttpError(413, f"body over {MAX_BODY} bytes")
        raw = self.rfile.read(length)
        if len(raw) != length:
            raise _HttpError(400, "body shorter than its Content-Length")
        try:
            return parse_request(raw.decode("utf-8"), "JSON")
        except UnicodeDecodeError as exc:
            raise _HttpError(400, f"bad JSON: {exc}") from None
        except MalformedRequest as exc:
            raise _HttpError(400, f"bad JSON: {exc.detail}") from None

    def _drain(self) -> None:
        """Read a body nobody needs (up to the limit), so closing the connection cannot reset the reply."""
        try:
            length = self._content_length()
        except _HttpError:
            return
        if length is not None and length <= MAX_BODY:
            self.rfile.read(length)

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
        self._send(status, (json.dumps(payload) + "\n").encode(), "application/json", headers)

    def _static(self, name: str) -> None:
        """One of the live page's files (module doc), or 404 where the package lacks it."""
        try:
            data = _page_file(name)
        except OSError:
            self._reply(404, {"error": f"no such endpoint: GET {self.path}"})
            return
        self._send(200, data, _TYPES[Path(name).suffix], {"Content-Security-Policy": _PAGE_POLICY})

    def _send(self, status: int, data: bytes, content_type: str, headers: Mapping[str, str]) -> None:
        try:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Type", content_type)
            self.send_header("Cache-Control", "no-store")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            if getattr(self, "command", None) != "HEAD":
                self.wfile.write(data)
        except OSError:
            pass  # the client hung up; nothing to tell it


@functools.cache
def _page_file(name: str) -> bytes:
    """A live page file's bytes, read from the package once."""
    return (files("lorafleet.train.queue") / "static" / name).read_bytes()


def _internal(method: str) -> str:
    """A 500's answer: that the server failed, never what its exception said (a path, a value of the run's)."""
    return "internal error" if method == "GET" else "internal error: the request was not queued"


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise _HttpError(400, '"name" must be a non-empty string')
    error = task_name_error(name)
    if error is not None:
        raise _HttpError(400, error)
    return name


def _check_request(body: Any) -> dict[str, Any]:
    """The shape only (a JSON object with a good "name" and a known "action"); the watcher validates."""
    if not isinstance(body, dict):
        raise _HttpError(400, "a request must be a JSON object")
    _check_name(body.get("name"))
    action = body.get("action", Action.ADD.value)
    if action not in tuple(Action):
        raise _HttpError(400, f'"action" must be one of {", ".join(Action)}, not {action!r}')
    return body


def _check_update(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise _HttpError(400, "an update must be a JSON object")
    unknown = sorted(set(body) - set(UPDATE_KEYS))
    if unknown:
        raise _HttpError(400, f"an update takes only {', '.join(UPDATE_KEYS)}, not {', '.join(unknown)}")
    if not body:
        raise _HttpError(400, f"an update needs one of {', '.join(UPDATE_KEYS)}")
    return {key: body[key] for key in UPDATE_KEYS if key in body}


def _mode(query: str) -> str:
    modes = parse_qs(query).get("mode", [Action.CANCEL.value])
    if len(modes) != 1 or modes[0] not in _STOPS:
        raise _HttpError(400, f"mode must be {' or '.join(_STOPS)}")
    return modes[0]


def _request_path(queue_dir: Path, name: str) -> Path:
    """``<UTC timestamp>-<name>.json``, with a counter where that name is taken (here or already moved)."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    candidate, counter = f"{stamp}-{name}.json", 0
    while any((folder / candidate).exists() for folder in (queue_dir, queue_dir / ACCEPTED, queue_dir / REJECTED)):
        counter += 1
        candidate = f"{stamp}-{name}-{counter}.json"
    return queue_dir / candidate


def _listing(queue_dir: Path, run_dir: Path) -> dict[str, Any]:
    ledger = _read_json(run_dir / LEDGER, "task ledger (tasks.json)")
    return {"ledger": ledger, **asdict(queue_view(queue_dir))}


def _task_view(name: str, run_dir: Path) -> dict[str, Any]:
    """One task: its ledger entry and its evaluations (``<out>/evaluations.json``: each evaluation's step, loss and
    token accuracy, the best, the early-stopping count, where it stopped); 404 when the run has no such task."""
    ledger = _read_json(run_dir / LEDGER, LEDGER) or {}
    entries = [e for e in ledger.get("tasks", ()) if e.get("spec", {}).get("name") == name]
    evaluations = (_read_json(run_dir / EVALUATIONS, EVALUATIONS) or {}).get(name)
    if not entries and evaluations is None:
        raise _HttpError(404, f"no task {name!r} in this run")
    return {"name": name, "ledger": entries[-1] if entries else None, "evaluations": evaluations}


def _read_json(path: Path, what: str) -> Any:
    """A run file's JSON (None when it is not there yet); 500 when it cannot be read."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        raise _HttpError(500, f"cannot read the run's {what}") from None


class QueueServer:
    """A queue server bound to its port (:func:`bind_queue_server`), serving once :meth:`serve` is called:
    ``url``, ``token``, ``token_file``, ``close()``; a context manager (closes on exit)."""

    def __init__(self, server: _Server) -> None:
        self._server = server
        self._thread: threading.Thread | None = None
        self.token_file: Path | None = None
        self.token = server.token
        self.host, self.port = server.server_address[:2]
        self.url = f"http://{self.host}:{self.port}"
        self._closed = False

    def serve(self, queue_dir: Path, run_dir: Path) -> None:
        """Serve ``queue_dir`` (created, 0700, if needed) of the run in ``run_dir`` from a daemon thread; the URL
        and the token go to ``<queue_dir>/.http.json`` (mode 0600)."""
        queue_dir, run_dir = Path(queue_dir), Path(run_dir)
        queue_dir.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
        self._server.queue_dir, self._server.run_dir = queue_dir, run_dir
        self._server.fleet = FleetWatch(RunDir(run_dir, queue_dir))
        threading.Thread(target=self._server.fleet.warm, name="lorafleet-fleet-view", daemon=True).start()
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": _POLL_S},
            name="lorafleet-queue-http",
            daemon=True,
        )
        self._thread.start()
        self.token_file = queue_dir / HTTP_TOKEN
        try:
            write_text_atomic(self.token_file, json.dumps({"url": self.url, "token": self.token}) + "\n", mode=PRIVATE)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop serving, join the thread, remove the token file (if it is still this server's). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()
        if self.token_file is None:
            return
        try:
            if json.loads(self.token_file.read_text(encoding="utf-8")).get("token") == self.token:
                self.token_file.unlink()
        except (OSError, ValueError, AttributeError):
            pass

    def __enter__(self) -> QueueServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bind_queue_server(port: int = 0) -> QueueServer:
    """A server bound to 127.0.0.1:``port`` (0: a free one) with a fresh token, not serving yet; an InputError
    naming ``--queue-http`` when the port cannot be bound (in use, or privileged)."""
    try:
        return QueueServer(_Server(port, secrets.token_urlsafe(32)))
    except OSError as err:
        raise InputError(
            "<args>",
            "--queue-http",
            f"cannot serve on {HOST}:{port} ({err.strerror or err}); choose another port, or 0",
        ) from None


def start_queue_server(queue_dir: Path, run_dir: Path, port: int = 0) -> QueueServer:
    """Bind 127.0.0.1:``port`` and serve ``queue_dir`` (:func:`bind_queue_server`, :meth:`QueueServer.serve`)."""
    server = bind_queue_server(port)
    server.serve(queue_dir, run_dir)
    return server


def remove_stale_token(queue_dir: Path) -> bool:
    """Remove ``<queue_dir>/.http.json`` that a run which ended without closing its server left (the caller
    holds the run directory: no live server of this run wrote it); whether there was one."""
    path = Path(queue_dir) / HTTP_TOKEN
    if not path.is_file():
        return False
    path.unlink()
    return True
