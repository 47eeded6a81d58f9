"""The queue's HTTP front-end against a real server on a free loopback port: it authenticates, writes
request files (and only those), and reads back the queue and the ledger."""

from __future__ import annotations

import http.client
import json
import os
import socket
import stat
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lorafleet.train.queue import QueueServer, start_queue_server

ADD = {"name": "chat2", "data": {"path": "/x/chat.jsonl"}, "batch_size": 8, "context_length": 256, "steps": 20}


@pytest.fixture
def queue(tmp_path: Path) -> Iterator[QueueServer]:
    with start_queue_server(tmp_path / "queue", tmp_path / "run") as server:
        yield server


def call(
    server: QueueServer, method: str, path: str, body: Any = None, *, token: str | None = "", raw: bytes | None = None
) -> tuple[int, dict[str, Any]]:
    """``method path`` with ``body`` as JSON (or ``raw`` bytes); ``token`` "" is the server's, None none."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(server.url + path, data=data, method=method)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token or server.token}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.headers["Content-Type"] == "application/json"
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        assert error.headers["Content-Type"] == "application/json"
        return error.code, json.loads(error.read())


def requests_in(queue_dir: Path) -> list[str]:
    """Everything in the queue directory but the token file and the watcher's folders."""
    return sorted(p.name for p in queue_dir.iterdir() if p.name not in (".http.json", "accepted", "rejected"))


def test_a_port_in_use_is_one_input_error_and_binding_writes_nothing(tmp_path):
    """The launcher binds before it claims the run directory (#25): a busy port is an InputError naming
    ``--queue-http``; a bound server writes nothing until it serves, then creates the queue private (0700)."""
    from lorafleet.errors import InputError
    from lorafleet.train.queue import bind_queue_server

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(
            InputError, match="--queue-http: cannot serve on 127.0.0.1:[0-9]+ \\(Address already in use"
        ):
            bind_queue_server(busy.getsockname()[1])
    with bind_queue_server(0) as server:
        assert not (tmp_path / "queue").exists() and server.token_file is None
        server.serve(tmp_path / "queue", tmp_path / "run")
        assert stat.S_IMODE(os.stat(tmp_path / "queue").st_mode) == 0o700
        assert call(server, "GET", "/v1/tasks")[0] == 200
    assert not (tmp_path / "queue" / ".http.json").exists()


def test_token_file_is_private_and_the_server_binds_loopback(tmp_path):
    queue_dir = tmp_path / "queue"
    server = start_queue_server(queue_dir, tmp_path / "run")
    try:
        token_file = queue_dir / ".http.json"
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
        assert json.loads(token_file.read_text()) == {"url": server.url, "token": server.token}
        assert server.host == "127.0.0.1" and server.url == f"http://127.0.0.1:{server.port}" and server.port > 0
        assert server._server.socket.getsockname()[0] == "127.0.0.1"
        assert len(server.token) >= 32
        assert call(server, "GET", "/v1/tasks")[0] == 200
    finally:
        server.close()
    assert not token_file.exists()
    server.close()  # idempotent
    with pytest.raises(OSError):
        urllib.request.urlopen(server.url + "/v1/tasks", timeout=1)


def test_every_request_needs_the_token(queue):
    for token in (None, "wrong-token"):
        assert call(queue, "GET", "/v1/tasks", token=token)[0] == 401
        status, payload = call(queue, "POST", "/v1/tasks", ADD, token=token)
        assert status == 401 and payload["error"]
    request = urllib.request.Request(queue.url + "/v1/tasks", headers={"Authorization": queue.token})
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=5)  # the token without "Bearer"
    assert raised.value.code == 401
    assert requests_in(Path(queue.token_file).parent) == []


def test_post_writes_one_request_file_with_the_body(queue):
    queue_dir = queue.token_file.parent
    body = {**ADD, "action": "add", "at_step": 5, "share": 0.25, "deadline": 100}
    status, payload = call(queue, "POST", "/v1/tasks", body)
    assert status == 202 and payload["status"] == "queued"
    assert requests_in(queue_dir) == [payload["file"]]
    name = payload["file"]
    stamp, _, rest = name.partition("-")
    assert rest == "chat2.json" and len(stamp) == 21 and stamp[8] == "T" and stamp.replace("T", "").isdigit()
    assert json.loads((queue_dir / name).read_text()) == body
    # the same name again gets a file of its own, sorting after the first
    second = call(queue, "POST", "/v1/tasks", ADD)[1]["file"]
    assert requests_in(queue_dir) == sorted([name, second]) and second > name


def test_delete_and_patch_write_their_actions(queue):
    queue_dir = queue.token_file.parent
    written = []
    for path, method, body, expected in (
        ("/v1/tasks/chat", "DELETE", None, {"action": "cancel", "name": "chat"}),
        ("/v1/tasks/chat?mode=finish", "DELETE", None, {"action": "finish", "name": "chat"}),
        ("/v1/tasks/chat?mode=cancel", "DELETE", None, {"action": "cancel", "name": "chat"}),
        ("/v1/tasks/chat", "PATCH", {"share": 0.5}, {"action": "update", "name": "chat", "share": 0.5}),
        (
            "/v1/tasks/chat",
            "PATCH",
            {"deadline": 80, "share": 1.0},
            {"action": "update", "name": "chat", "share": 1.0, "deadline": 80},
        ),
    ):
        status, payload = call(queue, method, path, body)
        assert status == 202, payload
        assert json.loads((queue_dir / payload["file"]).read_text()) == expected
        written.append(payload["file"])
    assert requests_in(queue_dir) == sorted(written) and len(set(written)) == 5


def test_get_lists_the_queue_and_the_ledger(queue, tmp_path):
    queue_dir = queue.token_file.parent
    assert call(queue, "GET", "/v1/tasks") == (200, {"ledger": None, "pending": [], "rejected": [], "accepted": []})
    pending = call(queue, "POST", "/v1/tasks", ADD)[1]["file"]
    (queue_dir / "by-hand.yaml").write_text("name: x\n")
    (queue_dir / "notes.txt").write_text("not a request")
    (queue_dir / ".hidden.json").write_text("{}")
    (queue_dir / "rejected").mkdir()
    (queue_dir / "rejected" / "bad.json").write_text("{}")
    (queue_dir / "rejected" / "bad.json.reason").write_text("unknown task 'nope'\n")
    (queue_dir / "accepted").mkdir()
    (queue_dir / "accepted" / "good.json").write_text("{}")
    ledger = {"tasks": [{"name": "chat", "state": "running", "share": 0.5}]}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tasks.json").write_text(json.dumps(ledger))
    status, payload = call(queue, "GET", "/v1/tasks")
    assert status == 200
    assert payload == {
        "ledger": ledger,
        "pending": sorted([pending, "by-hand.yaml"]),
        "rejected": [{"file": "bad.json", "reason": "unknown task 'nope'"}],
        "accepted": ["good.json"],
    }


@pytest.mark.parametrize(
    "method,path,raw",
    [
        ("POST", "/v1/tasks", b"{not json"),
        ("POST", "/v1/tasks", b"NaN"),
        ("POST", "/v1/tasks", b'["a list"]'),
        ("POST", "/v1/tasks", b'{"data": {}}'),
        ("POST", "/v1/tasks", b'{"name": ""}'),
        ("POST", "/v1/tasks", b'{"name": "../escape"}'),
        ("POST", "/v1/tasks", b'{"name": ".hidden"}'),
        ("POST", "/v1/tasks", b'{"name": "chat", "action": "explode"}'),
        ("POST", "/v1/tasks", b"\xff\xfe"),
        ("PATCH", "/v1/tasks/chat", b"{}"),
        ("PATCH", "/v1/tasks/chat", b'{"share": 0.5, "name": "other"}'),
        ("PATCH", "/v1/tasks/chat", b"{oops"),
        ("DELETE", "/v1/tasks/chat?mode=explode", b""),
        ("DELETE", "/v1/tasks/bad%2Fname", b""),
        ("POST", "/v1/tasks", b'{"name": "' + b"a" * 65 + b'"}'),  # a task name is at most 64 characters everywhere
        ("DELETE", "/v1/tasks/" + "a" * 65, b""),
    ],
)
def test_bad_requests_are_400_and_write_nothing(queue, method, path, raw):
    status, payload = call(queue, method, path, raw=raw if raw else None)
    assert status == 400 and payload["error"] and "\n" not in payload["error"]
    assert requests_in(queue.token_file.parent) == []


def test_unknown_endpoints_are_404(queue):
    for method, path in (
        ("GET", "/v1"),
        ("GET", "/page.js"),
        ("GET", "/v1/tasks/chat"),
        ("POST", "/v1/other"),
        ("PUT", "/v1/tasks"),
    ):
        status, payload = call(queue, method, path, {} if method in ("POST", "PUT") else None)
        assert status == 404 and payload["error"]
    assert requests_in(queue.token_file.parent) == []


def _headers_only(queue: QueueServer, method: str, headers: dict[str, str]) -> int:
    connection = http.client.HTTPConnection(queue.host, queue.port, timeout=5)
    try:
        connection.putrequest(method, "/v1/tasks")
        connection.putheader("Authorization", f"Bearer {queue.token}")
        for key, value in headers.items():
            connection.putheader(key, value)
        connection.endheaders()
        response = connection.getresponse()
        assert json.loads(response.read())["error"]
        return response.status
    finally:
        connection.close()


def test_length_missing_or_too_big(queue):
    assert _headers_only(queue, "POST", {}) == 411
    assert _headers_only(queue, "POST", {"Content-Length": str(2 << 20)}) == 413
    assert _headers_only(queue, "POST", {"Content-Length": "many"}) == 400
    assert requests_in(queue.token_file.parent) == []
    assert call(queue, "POST", "/v1/tasks", ADD)[0] == 202  # still serving


def test_bad_traffic_neither_logs_nor_stops_the_server(queue, capfd):
    with socket.create_connection((queue.host, queue.port), timeout=5) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        reply = sock.makefile("rb").read()
    assert reply.startswith(b"HTTP/1.0 400") and b'"error"' in reply
    with socket.create_connection((queue.host, queue.port), timeout=5) as sock:
        sock.sendall(b"GET /v1/tasks HTTP/9.9\r\n\r\n")
        reply = sock.makefile("rb").read()
    assert reply.startswith(b"HTTP/1.0 505") and b'"error"' in reply
    with socket.create_connection((queue.host, queue.port), timeout=5):
        pass  # a client that hangs up at once
    assert call(queue, "GET", "/nowhere")[0] == 404
    assert call(queue, "GET", "/v1/tasks", token=None)[0] == 401
    assert call(queue, "GET", "/v1/tasks")[0] == 200
    out, err = capfd.readouterr()
    assert out == "" and err == ""


@pytest.mark.parametrize(
    "method, path, raw, words",
    [
        ("POST", "/v1/tasks", b"[" * 100_000 + b"]" * 100_000, "bad JSON: nested deeper than 32 levels"),
        ("POST", "/v1/tasks", b'{"name": "c", "x": ' + b"[" * 40 + b"]" * 40 + b"}", "nested deeper"),
        ("POST", "/v1/tasks", json.dumps({**ADD, "share": 0.5}).encode()[:-1] + b', "x": 1e999}', "1e999 is not a"),
        ("PATCH", "/v1/tasks/chat", b'{"share": 1e999}', "bad JSON: 1e999 is not a finite number"),
        ("PATCH", "/v1/tasks/chat", b'{"deadline": -1E400}', "bad JSON: -1E400 is not a finite number"),
    ],
)
def test_a_body_nested_too_deep_or_not_finite_is_400_and_writes_nothing(queue, method, path, raw, words):
    """#38: a body nested 100,000 deep answered 500 (a RecursionError), and a share of 1e999 was written into
    the request file as ``Infinity``. The body is parsed as a request file is (``requests.parse_request``)."""
    status, body = call(queue, method, path, raw=raw)
    assert status == 400 and words in body["error"] and "\n" not in body["error"], body
    assert requests_in(queue.token_file.parent) == []


def test_an_unexpected_error_is_500_without_the_exceptions_text(queue, tmp_path, monkeypatch):
    """A 500 says that the server failed, never what the exception said (a path, a value of the run's)."""
    from lorafleet.train.queue import http

    (tmp_path / "run" / "tasks.json").mkdir(parents=True)  # a ledger that cannot be read
    status, body = call(queue, "GET", "/v1/tasks")
    assert status == 500 and "Errno" not in body["error"] and str(tmp_path) not in body["error"], body

    def fail(*args: object) -> None:
        raise RuntimeError(f"secret {tmp_path}")

    monkeypatch.setattr(http, "_request_path", fail)
    status, body = call(queue, "POST", "/v1/tasks", ADD)
    assert status == 500 and body == {"error": "internal error: the request was not queued"}, body


def test_120_concurrent_posts_all_get_an_answer(queue):
    """#38: 85 of 120 concurrent POSTs were reset (the server's listen backlog was 5); every one is answered
    now (``request_queue_size``) and queued once."""
    import threading

    n = 120
    start = threading.Barrier(n)
    answers: list[object] = [None] * n

    def post(i: int) -> None:
        start.wait()
        connection = http.client.HTTPConnection(queue.host, queue.port, timeout=120)
        try:
            body = json.dumps({**ADD, "name": f"t{i}"})
            headers = {"Authorization": f"Bearer {queue.token}", "Content-Type": "application/json"}
            connection.request("POST", "/v1/tasks", body=body, headers=headers)
            answers[i] = connection.getresponse().status
        except OSError as err:
            answers[i] = repr(err)
        finally:
            connection.close()

    threads = [threading.Thread(target=post, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [202] * n
    assert len(requests_in(queue.token_file.parent)) == n


def test_a_tasks_view_has_its_ledger_entry_and_its_evaluations(queue, tmp_path):
    """``GET /v1/tasks/<name>``: what the run wrote of the task (``tasks.json``, ``evaluations.json``); 404 for a
    task the run never had, and PATCH takes an update of the evaluation cadence and early stopping."""
    run = tmp_path / "run"
    run.mkdir()
    spec = {"name": "chat", "data": {"path": "/x/chat.jsonl"}, "batch_size": 2, "context_length": 64}
    (run / "tasks.json").write_text(json.dumps({"applied": [], "tasks": [{"spec": spec, "left": None}]}))
    assert call(queue, "GET", "/v1/tasks/chat") == (200, {"name": "chat", "ledger": {"spec": spec, "left": None},
                                                          "evaluations": None})  # fmt: skip
    evaluated = {"history": [[4, 2.5, 0.3], [8, 2.6, 0.3]], "stopped_at": None, "steps_not_taken": None,
                 "stopping": {"evaluations": 2, "best_loss": 2.5, "best_step": 4, "bad": 1, "stopped": False,
                              "improved": False}}  # fmt: skip
    (run / "evaluations.json").write_text(json.dumps({"chat": evaluated}))
    assert call(queue, "GET", "/v1/tasks/chat")[1]["evaluations"] == evaluated
    assert call(queue, "GET", "/v1/tasks/nobody")[0] == 404
    status, payload = call(queue, "PATCH", "/v1/tasks/chat", {"eval": {"every_steps": 5}, "early_stopping": None})
    assert status == 202, payload
    (written,) = requests_in(tmp_path / "queue")
    assert json.loads((tmp_path / "queue" / written).read_text()) == {
        "action": "update", "name": "chat", "eval": {"every_steps": 5}, "early_stopping": None,
    }  # fmt: skip
