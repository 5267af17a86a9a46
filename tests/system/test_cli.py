"""The command line, as a user runs it: serve (and restart), demo-model, fingerprint."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from cacheproxy.runners.demo.model import BUNDLED_MODEL
from tests.conftest import free_port
from tests.harness.processes import CLI, serving


def _ask(url: str) -> tuple[str, str | None]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="cacheproxy-demo", messages=[{"role": "user", "content": "What color is the cat?"}])
    content = raw.parse().choices[0].message.content
    assert content
    return content, raw.headers.get("x-cache")


def test_restart_with_disk_store_first_request_is_a_hit(tmp_path: Path) -> None:
    store = f"disk://{tmp_path}/store"
    with serving("--store", store) as url:
        first, status = _ask(url)
        assert status == "MISS"
    with serving("--store", store) as url:
        again, status = _ask(url)
        assert status == "HIT"
    assert again == first


def test_one_json_log_line_per_request_without_prompts(tmp_path: Path) -> None:
    output: list[str] = []
    with serving("--store", "memory://", "--log-format", "json", output=output) as url:
        secret = "What color is the secret fox?"
        body = json.dumps({"messages": [{"role": "user", "content": secret}]}).encode()
        for _ in range(2):
            req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                         headers={"X-Request-Id": "req-42"})
            urllib.request.urlopen(req, timeout=30).read()
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(url + "/nope", timeout=5)
        too_long = json.dumps({"messages": [{"role": "user", "content": "fox " * 900}]})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(
                url + "/v1/chat/completions", data=too_long.encode()), timeout=30)
        assert refused.value.code == 400
    text = output[0]
    assert secret not in text  # prompts never at INFO
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    requests = [e for e in lines if e["event"] == "request"]
    paths = [e["path"] for e in requests]
    assert paths.count("/v1/chat/completions") == 3 and paths.count("/nope") == 1
    chat = [e for e in requests if e["path"] == "/v1/chat/completions" and e["status"] == 200]
    assert [e["cache"] for e in chat] == ["MISS", "HIT"]
    for e in chat:
        assert e["request_id"] == "req-42" and e["status"] == 200
        assert e["level"] == "info" and e["total_ms"] >= 0 and len(e["key"]) == 12
    assert next(e for e in requests if e["path"] == "/nope")["status"] == 404
    # Every line of stdout and stderr is JSON (#34): the start-up banner, the model load,
    # the tokenizer's own warning of a prompt too long.
    assert [line for line in text.splitlines() if not line.startswith("{")] == []
    assert any(e.get("logger", "").startswith("transformers") for e in lines)
    (banner,) = [e for e in lines if e["event"] == "listening"]
    assert banner["message"].startswith("cacheproxy serving cacheproxy-demo on http://")


def test_connections_past_the_bound_get_503(tmp_path: Path) -> None:
    import socket

    output: list[str] = []
    with serving("--store", "memory://", "--max-connections", "2", output=output) as url:
        port = int(url.rsplit(":", 1)[1])
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        # Both busy with a request being answered (a long generation, the second queued
        # behind the first): neither can give way. (One still sending its body would: the
        # oldest body is cut with a 408 to make room, see tests/e2e/test_connection_bounds.)
        eos = json.loads((BUNDLED_MODEL / "config.json").read_text())["eos_token_id"]
        long = json.dumps({"prompt": "Once upon a time", "max_tokens": 400,
                           "logit_bias": {str(t): -100 for t in eos}}).encode()
        try:
            for sock in held:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                             b"application/json\r\nContent-Length: %d\r\n\r\n%b"
                             % (len(long), long))
            time.sleep(0.2)
            with socket.create_connection(("127.0.0.1", port), timeout=5) as third:
                answer = third.recv(4096)
            assert answer.startswith(b"HTTP/1.1 503")
            assert b'"code":"overloaded"' in answer and b"Retry-After: 1" in answer
        finally:
            for s in held:
                s.close()
        # The held connections are gone (their handlers end with their generations): a new
        # one is admitted again.
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                    assert resp.status == 200
                    break
            except urllib.error.HTTPError as exc:
                assert exc.code == 503 and time.monotonic() < deadline
                time.sleep(0.2)
    assert "Traceback" not in output[0] and "Task exception" not in output[0]  # (#19)


def _open_file_limit(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open-file limit in /proc")


def test_serve_keeps_the_open_file_limit_mlx_lm_lowers_and_warns_when_it_is_short() -> None:
    """mlx-lm sets (2048, 4096) on import; the server puts back what it started with (3000
    here, under any hard limit a user may keep) and says that 5000 connections will not fit."""
    import resource

    port = free_port()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]

    def start_with_3000() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (3000, hard))

    proc = subprocess.Popen([*CLI, "serve", "--port", str(port), "--store", "memory://",
                             "--max-connections", "5000"], preexec_fn=start_with_3000,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        import mlx_lm  # noqa: F401  (what the server imported: is it still lowering the limit?)

        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] <= 2048, \
            "mlx-lm no longer lowers the limit on import: this test and the workaround can go"
        soft_now, hard_now = _open_file_limit(proc.pid)
        assert soft_now == 3000  # not mlx-lm's 2048
        assert hard_now in (hard, 4096)  # put back where the process may raise it (privileges)
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0].decode()
    assert proc.returncode == 0, out
    assert "WARNING: the open-file limit (3000) leaves room for fewer than " \
        "--max-connections 5000" in out


def test_a_hard_limit_that_cannot_be_raised_again_leaves_the_soft_one_under_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """Fake: a process without privileges cannot raise a hard limit; root (these tests) can."""
    import resource

    from cacheproxy.cli import serve as cli

    calls: list[tuple[int, int]] = []

    def setrlimit(_: int, limits: tuple[int, int]) -> None:
        calls.append(limits)
        if limits[1] > 4096:
            raise ValueError("not allowed to raise maximum limit")

    monkeypatch.setattr(resource, "getrlimit", lambda _: (2048, 4096))
    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    cli.restore_file_limit((65536, 65536), 1000)
    assert calls == [(65536, 65536), (4096, 4096)]
    assert "WARNING" not in capsys.readouterr().err  # 2048 (the fake reads it) fits 1000


def _complete(url: str, model: str) -> dict[str, str]:
    body = json.dumps({"model": model, "prompt": "The fox", "max_tokens": 8}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        assert json.loads(resp.read())["model"] == model  # the name the client used
        return dict(resp.headers)


def test_two_installs_of_the_same_files_share_entries_and_purge_nothing(tmp_path: Path) -> None:
    """(#21) The fingerprint is content-addressed: the same model files under another path
    and another name are the same producer. The second start-up is a HIT on the first's
    entries, and neither start-up supersedes the other's namespace."""
    from cacheproxy.runners.demo.model import write_copy

    first, second = write_copy(tmp_path / "a"), write_copy(tmp_path / "b")
    store = f"disk://{tmp_path / 'store'}"
    with serving("--model", str(first), "--model-id", "one", "--store", store, "--no-watch",
                 "--supersede-grace", "0") as url:
        miss = _complete(url, "one")
    with serving("--model", str(second), "--model-id", "two", "--store", store, "--no-watch",
                 "--supersede-grace", "0") as url:
        hit = _complete(url, "two")
    assert (miss["X-Cache"], hit["X-Cache"]) == ("MISS", "HIT")
    assert miss["X-Cache-Fingerprint"] == hit["X-Cache-Fingerprint"]
    out = subprocess.run([*CLI, "stats", "--store", store, "--json"], check=True,
                         capture_output=True, text=True)
    (namespace,) = json.loads(out.stdout)["namespaces"]
    assert (namespace["state"], namespace["entries"]) == ("current", 1)


def test_bad_serve_values_exit_2_with_a_message(tmp_path: Path) -> None:
    """(Processes of their own: `serve` binds its port and configures the process's logging
    before it opens the store or loads the model.)"""
    out = subprocess.run([*CLI, "serve", "--store", "ftp://x", "--port", "0"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "ftp://x" in out.stderr
    out = subprocess.run([*CLI, "serve", "--model", str(tmp_path / "missing"), "--port", "0"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "does not exist" in out.stderr
