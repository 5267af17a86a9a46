"""The one-slot lane's queueing note, and the decode-slots setting in the fingerprint."""

from __future__ import annotations

import msgpack
import pytest
import xxhash
from structlog.testing import capture_logs

from cacheproxy.cli.settings import build_settings
from cacheproxy.keys import fingerprint as fp
from cacheproxy.runners.demo.model import BUNDLED_MODEL
from cacheproxy.runners.slots import NOTE_EVERY, QueueNote


def test_misses_queued_behind_a_one_slot_lane_are_noted_at_most_once_a_minute() -> None:
    now = [100.0]
    note = QueueNote("m", clock=lambda: now[0])
    with capture_logs() as logs:
        note.behind(1)
        note.behind(2)
        now[0] += NOTE_EVERY
        note.behind(3)
    assert [(e["event"], e["queued"], e["queued_behind"]) for e in logs] == [
        ("misses_queue_behind_one_slot", 1, 1), ("misses_queue_behind_one_slot", 3, 3)]
    assert note.queued_behind == 3


def test_one_slot_keeps_the_digest_entries_were_keyed_under_and_more_slots_join_it() -> None:
    one = fp.compute("m", BUNDLED_MODEL, prefill_step=512)
    assert one.decode_slots == 1 and one.fields()["decode_slots"] == 1
    # The digest as it was computed before the field existed.
    produced = {k: v for k, v in one.fields().items()
                if k not in fp.UNDIGESTED and k != "decode_slots"}
    packed = msgpack.packb([fp.FINGERPRINT_SCHEMA, produced], use_bin_type=True)
    assert one.digest == xxhash.xxh3_128_hexdigest(packed)
    eight = fp.compute("m", BUNDLED_MODEL, prefill_step=512, decode_slots=8)
    assert eight.digest != one.digest
    assert fp.compute("m", BUNDLED_MODEL, prefill_step=512, decode_slots=16).digest != \
        eight.digest


def test_decode_slots_comes_from_the_flag_or_the_environment_and_is_bounded() -> None:
    assert build_settings({}, {}).decode_slots == 1
    assert build_settings({}, {"CACHEPROXY_DECODE_SLOTS": "8"}).decode_slots == 8
    assert build_settings({"decode_slots": 4}, {"CACHEPROXY_DECODE_SLOTS": "8"}).decode_slots == 4
    with pytest.raises(ValueError, match="setting 'decode_slots'"):
        build_settings({"decode_slots": 0}, {})
    with pytest.raises(ValueError, match="--decode-slots is for the in-process runner"):
        build_settings({"decode_slots": 8, "upstream": ["http://127.0.0.1:1"],
                        "model_dir": "/tmp"}, {})

