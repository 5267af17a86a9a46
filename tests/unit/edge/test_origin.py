"""When the browser guard applies, and how it reads Host names (no event loop)."""

from __future__ import annotations

from cacheproxy.edge.origin import _hostname, site_guard


def test_the_guard_applies_only_on_loopback_without_keys() -> None:
    assert site_guard("127.0.0.1", ()) is not None
    assert site_guard("::1", ()) is not None
    assert site_guard("localhost", ()) is not None
    assert site_guard("127.0.0.1", ("sk-1",)) is None  # the keys are the guard
    assert site_guard("0.0.0.0", ()) is None  # beyond loopback: keys are the operator's call


def test_host_names_lose_their_port_and_brackets() -> None:
    assert _hostname("127.0.0.1:8080") == "127.0.0.1"
    assert _hostname("[::1]:8080") == "::1"
    assert _hostname("Evil.Example.com") == "evil.example.com"
    assert _hostname("::1") == "::1"


def test_allowed_hosts_and_origins_are_comma_lists_and_the_bound_host_is_allowed() -> None:
    guard = site_guard("127.0.0.2", (), hosts=["a.test, b.test:80"],
                       origins=["https://app.test/"])
    assert guard is not None
    assert guard.hosts == {"a.test", "b.test", "127.0.0.2"}
    assert guard.origins == {"https://app.test"}
    assert guard._host_ok("x")  # single-label: no public DNS name can be rebound to it
    assert not guard._host_ok("c.test")
    assert not guard._host_ok("10.0.0.1")
