"""The runners `cacheproxy verify` and `cacheproxy compare` replay on: the one `--model` names,
or a candidate (a model directory run in-process, or a running mlx_lm.server's URL)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from cacheproxy.cli.settings import Settings
from cacheproxy.runners.base import Runner


def is_url(target: str) -> bool:
    """Whether a candidate names an upstream server rather than a model directory."""
    return target.startswith(("http://", "https://"))


def mlx_runner(settings: Settings, model: str) -> Runner:
    """An in-process runner of `model` with the settings' pinned runner knobs."""
    from cacheproxy.runners.mlx import MlxOptions, MlxRunner

    return MlxRunner(MlxOptions(model=model, model_id=settings.served_model_id,
                                digest_memo=Path(settings.digest_memo),
                                prefill_step=settings.prefill_step,
                                prefix_cache_bytes=settings.prefix_cache_bytes,
                                decode_slots=settings.decode_slots,
                                prefill_process=settings.prefill_process))


def candidate_runner(settings: Settings, target: str, model_dir: str | None) -> Runner:
    """The runner of a candidate; an upstream's is told the model directory it serves
    (`model_dir`, default: the one `--model` names) to fingerprint it."""
    if not is_url(target):
        if not (Path(target).expanduser() / "config.json").exists():
            raise ValueError(f"--to {target}: neither an http(s) URL nor a model directory "
                             "(no config.json)")
        return mlx_runner(settings, str(Path(target).expanduser()))
    from cacheproxy.runners.mlx import resolve_model_path
    from cacheproxy.runners.upstream import UpstreamRunner
    from cacheproxy.runners.upstream_model import UpstreamOptions

    served = Path(model_dir).expanduser() if model_dir else \
        resolve_model_path(settings.model_for(settings.served_model_id))
    return UpstreamRunner(UpstreamOptions(
        urls=(target.rstrip("/"),), model_dir=served, model_id=settings.served_model_id,
        digest_memo=Path(settings.digest_memo), timeout=settings.upstream_timeout))


@asynccontextmanager
async def started(runner: Runner) -> AsyncIterator[Runner]:
    """A started runner, closed on the way out."""
    try:
        await runner.start()
        yield runner
    finally:
        await runner.aclose()


def stored_namespace(settings: Settings) -> str:
    """The fingerprint digest of what `--model` serves (compare's default namespace), from the
    files and the runner knobs, without loading the weights."""
    from cacheproxy.keys.digests import DigestMemo
    from cacheproxy.runners.mlx import local_fingerprint, resolve_model_path

    model = settings.model_for(settings.served_model_id)
    return local_fingerprint(settings.served_model_id, resolve_model_path(model),
                             prefill_step=settings.prefill_step,
                             decode_slots=settings.decode_slots,
                             memo=DigestMemo(Path(settings.digest_memo))).digest
