"""docker-compose.yml: valid structure, and the proxy's command line parses with the real CLI.

No Docker engine runs here, so the file is checked, not started.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from cacheproxy.cli.main import _parser
from cacheproxy.cli.settings import build_settings

ROOT = Path(__file__).parents[2]


def _compose() -> dict[str, object]:
    data = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(data, dict)
    return data


def test_compose_has_runner_redis_and_proxy_with_health_checks() -> None:
    services = _compose()["services"]
    assert isinstance(services, dict)
    assert set(services) == {"runner", "redis", "proxy"}
    for name, service in services.items():
        assert "test" in service["healthcheck"], name
    # The runner prefills cold: mlx_lm.server's prompt cache reuses at any token boundary.
    assert " ".join(services["runner"]["command"]).endswith("--prompt-cache-size 0")
    redis_cmd = " ".join(services["redis"]["command"])
    assert "--appendonly yes" in redis_cmd and "allkeys-lru" in redis_cmd
    proxy = services["proxy"]
    assert proxy["depends_on"]["runner"]["condition"] == "service_healthy"
    assert proxy["depends_on"]["redis"]["condition"] == "service_healthy"
    assert (ROOT / "Dockerfile").exists() and proxy["build"] == "."


def test_proxy_command_parses_with_the_real_cli() -> None:
    proxy = _compose()["services"]["proxy"]  # type: ignore[index]
    args = _parser().parse_args(proxy["command"])
    assert args.command == "serve"
    flags = {k: v for k, v in vars(args).items() if k != "command"}
    pools = build_settings(flags, {}).upstream_pools
    assert [(p.model_dir, p.urls) for p in pools] == [("/models/demo", ("http://runner:8081",))]
    assert args.store == "tiered+redis://redis:6379/0"  # L1 kept coherent by Redis
    from backends import open_backend

    open_backend(args.store)  # the store URL is one the proxy accepts (no connection made)
