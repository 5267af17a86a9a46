"""Router: which model's proxy answers a body, decoding it once at most (#35)."""

from __future__ import annotations

import orjson

from cacheproxy.edge.routing import Router
from cacheproxy.service.memos import MAX_MEMO_BODY


def _body(model: object, pad: int = 0) -> bytes:
    return orjson.dumps({"model": model, "prompt": "x" * pad})


def test_one_model_under_several_names_never_looks_at_the_body() -> None:
    router = Router({"demo": "A", "/models/demo": "A", "./demo": "A"}, "A")
    assert router.single
    assert [router.route(b) for b in (_body("demo"), b"not json", _body("other"))] == ["A"] * 3
    assert router.decodes == 0


def test_several_models_decode_a_body_once() -> None:
    router = Router({"demo": "A", "demo-alias": "A", "twin": "B"}, "A")
    assert not router.single
    for _ in range(3):
        assert (router.route(_body("demo-alias")), router.route(_body("twin"))) == ("A", "B")
    assert router.decodes == 2


def test_a_body_is_remembered_per_cache_scope() -> None:
    router = Router({"demo": "A", "twin": "B"}, "A")
    assert [router.route(_body("twin"), scope) for scope in ("k1", "k2", "k1")] == ["B"] * 3
    assert router.decodes == 2  # k2's first is decoded: k1's sending it does not show


def test_what_names_no_served_model_goes_to_the_default_and_is_not_remembered() -> None:
    router = Router({"demo": "A", "twin": "B"}, "A")
    bad = (b"not json", b"[1]", _body(None), _body(7), _body("other"))
    for _ in range(2):
        assert [router.route(b) for b in bad] == ["A"] * len(bad)
    assert router.decodes == 2 * len(bad)


def test_a_body_bigger_than_the_memos_take_is_decoded_every_time() -> None:
    router = Router({"demo": "A", "twin": "B"}, "A")
    big = _body("twin", pad=MAX_MEMO_BODY)
    assert [router.route(big) for _ in range(2)] == ["B", "B"]
    assert router.decodes == 2


def test_remembered_bodies_are_bounded() -> None:
    router = Router({"demo": "A", "twin": "B"}, "A", max_entries=2)
    bodies = [_body("twin", pad=n) for n in range(3)]
    for body in bodies:
        router.route(body)
    router.route(bodies[0])  # pushed out by the third
    assert router.decodes == 4
