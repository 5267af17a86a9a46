"""Signed records end to end: a real answer exported with a record key, a forged copy (its
checksum recomputed) refused by `import` and by a replaying jsonl:// cassette with a
line-numbered error; the genuine file imports. A 164 MB line is refused without being read."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import xxhash

from cacheproxy.cli.main import run
from cacheproxy.cli.settings import DEMO_MODEL_ID
from cacheproxy.keys import codec, transcript
from cacheproxy.service.cassette import open_store
from tests.conftest import ProxyFactory

SECRET = "a record key"


def forge(line: bytes) -> bytes:
    """The line answering otherwise, its checksum recomputed (anyone can)."""
    data = json.loads(line)
    key, record = transcript.from_line(line)
    first = record.output.chunks[0]
    chunks = (replace(first, text="FORGED"), *record.output.chunks[1:])
    output = codec.Output(chunks, record.output.finish_reason, record.output.prompt_tokens,
                          record.output.completion_tokens)
    data["output"]["chunks"][0]["text"] = "FORGED"
    data["output"]["text"] = output.text
    data["checksum"] = xxhash.xxh3_64_hexdigest(codec.encode(
        codec.Record(record.request, output, record.provenance)))
    return json.dumps(data).encode() + b"\n"


async def test_a_forged_export_is_refused_by_import_and_by_replay(
        make_proxy: ProxyFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = f"disk://{tmp_path / 'store'}"
    proxy = await make_proxy(store=store)
    await proxy.client.chat.completions.create(
        model=DEMO_MODEL_ID, max_tokens=6, messages=[{"role": "user", "content": "Hello"}])
    await proxy.stop()
    signed = tmp_path / "signed.jsonl"
    code = await asyncio.to_thread(run, ["export", "--store", store, "--out", str(signed),
                                         "--record-key", SECRET])
    assert code == 0
    line = signed.read_bytes()
    assert b'"signature"' in line
    fake = tmp_path / "fake.jsonl"
    fake.write_bytes(line + forge(line))  # line 2 is the forgery
    into = f"disk://{tmp_path / 'other'}"
    capsys.readouterr()
    code = await asyncio.to_thread(run, ["import", str(fake), "--store", into,
                                         "--record-key", SECRET])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "line 2: signature mismatch" in err and "Traceback" not in err
    # A replaying cassette (what `serve --replay --store jsonl://...` opens) refuses it too.
    with pytest.raises(ValueError, match="line 2: signature mismatch"):
        await open_store(f"jsonl://{fake}", replay=True, record_key=SECRET.encode())
    unsigned = tmp_path / "unsigned.jsonl"
    code = await asyncio.to_thread(run, ["export", "--store", store, "--out", str(unsigned)])
    with pytest.raises(ValueError, match="line 1: unsigned record"):
        await open_store(f"jsonl://{unsigned}", replay=True, record_key=SECRET.encode())
    # Controls: the genuine file imports; without a key the forgery would have (the checksum
    # alone proves nothing about who wrote a line).
    assert await asyncio.to_thread(run, ["import", str(signed), "--store", into,
                                         "--record-key", SECRET]) == 0
    cassette = await open_store(f"jsonl://{fake}", replay=True)
    await cassette.aclose()


def test_a_164_mb_line_is_refused_early_in_bounded_memory(tmp_path: Path) -> None:
    huge = tmp_path / "huge.jsonl"
    with huge.open("wb") as out:
        out.write(b'{"key": "' + b"a" * (164 << 20) + b'"}\n')
    probe = ("import sys\n"
             "from pathlib import Path\n"
             "from cacheproxy.cli.transfer import read_lines\n"
             "def kb(field):\n"
             "    return int(next(x for x in open('/proc/self/status')\n"
             "                    if x.startswith(field)).split()[1])\n"
             "open('/proc/self/clear_refs', 'w').write('5')  # the peak starts from now\n"
             "before = kb('VmRSS')\n"
             "try:\n"
             "    read_lines(Path(sys.argv[1]))\n"
             "except ValueError as exc:\n"
             "    print(exc)\n"
             "print((kb('VmHWM') - before) // 1024)\n")
    done = subprocess.run([sys.executable, "-c", probe, str(huge)], capture_output=True,
                          text=True, timeout=120)
    message, peak_mb = done.stdout.strip().splitlines()
    print(f"peak RSS growth reading a 164 MB line: {peak_mb} MB")
    assert "line 1: longer than" in message, done.stderr
    assert int(peak_mb) < 160  # ~2x the 64 MB bound, not the line (read whole: ~2 GB)
