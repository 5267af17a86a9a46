"""Settings from flags and the environment (cli/settings.py), no process of their own."""

from __future__ import annotations

from pathlib import Path

import pytest

from cacheproxy.cli.settings import Settings, build_settings


def test_default_store_is_on_disk_under_the_user_cache_dir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert Settings().store == f"disk://{tmp_path}/cache/cacheproxy/store"


def test_env_setting_and_flag_precedence() -> None:
    env = {"CACHEPROXY_PORT": "9000", "CACHEPROXY_SAMPLING": "seeded"}
    assert build_settings({}, env).port == 9000
    assert build_settings({"port": 9001}, env).port == 9001
    assert build_settings({}, env).sampling == "seeded"
    with pytest.raises(ValueError, match="sampling"):
        build_settings({}, {"CACHEPROXY_SAMPLING": "wild"})


def test_a_model_path_with_an_equals_sign_is_a_path_not_an_id() -> None:
    """A spec that starts as a path (/, ~, .) is a path, `=` and all; ID=PATH as before."""
    def served(model: str, model_id: str = "") -> tuple[tuple[str, str], ...]:
        return Settings(model=model, model_id=model_id).served_models

    assert served("/m/a=b") == (("/m/a=b", "/m/a=b"),)
    assert served("/m/a=b", "mine") == (("mine", "/m/a=b"),)
    assert served("x=/m/a=b,./y=z") == (("x", "/m/a=b"), ("./y=z", "./y=z"))
    assert served("org/name=~/m") == (("org/name", "~/m"),)
    with pytest.raises(ValueError, match="'x='"):
        served("x=,y=/m")
    with pytest.raises(ValueError, match="'='"):
        served("=")


def test_the_prefill_process_is_on_unless_the_flag_or_the_environment_turns_it_off() -> None:
    from cacheproxy.cli.main import _parser

    assert build_settings({}, {}).prefill_process is True
    assert build_settings({}, {"CACHEPROXY_PREFILL_PROCESS": "false"}).prefill_process is False
    args = vars(_parser().parse_args(["serve", "--no-prefill-process"]))
    flags = {k: v for k, v in args.items() if k != "command"}  # (as `run` passes them)
    assert build_settings(flags, {}).prefill_process is False
