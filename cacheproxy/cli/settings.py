"""One frozen Settings, built once: CLI flags > environment (CACHEPROXY_*) > defaults."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends import default_disk_url
from cacheproxy.runners.demo.model import BUNDLED_MODEL
from cacheproxy.runners.mlx import PREFILL_STEP, PREFIX_CACHE_BYTES
from policies.invalidation import InvalidationPolicy
from policies.sampling import SamplingMode

DEMO_MODEL_ID = "cacheproxy-demo"
ENV_PREFIX = "CACHEPROXY_"


def default_digest_memo() -> str:
    """Where remembered weight-file digests live: the user cache directory."""
    import platformdirs

    return str(Path(platformdirs.user_cache_dir("cacheproxy")) / "digests.json")


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Every knob of `cacheproxy serve`. Times are float seconds, sizes bytes."""

    host: str = "127.0.0.1"
    port: int = 8080
    model: str = str(BUNDLED_MODEL)
    model_id: str = ""
    store: str = dataclasses.field(default_factory=default_disk_url)
    sampling: SamplingMode = SamplingMode.FORCE_GREEDY
    queue_size: int = 64
    generation_timeout: float = 300.0
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256
    max_tokens_cap: int = 4096
    # What one answer may hold: choices x tokens x (1 + logprob alternatives); ~60 bytes each.
    max_answer_tokens: int = 1 << 18
    # What one request's schemas may cost (keys/budget.py): 400 schema_too_complex past it.
    max_schema_bytes: int = 256 << 10
    max_schema_properties: int = 5000
    max_enum_values: int = 1000
    max_tools: int = 128
    max_schema_depth: int = 64
    schema_timeout: float = 5.0  # CPU seconds one request's schema checks may use
    parse_off_loop: bool = True  # False (env only): schema checks on the event loop, a diagnostic
    prefill_step: int = PREFILL_STEP  # in-process: pinned in the fingerprint
    prefix_cache_bytes: int = PREFIX_CACHE_BYTES  # in-process exact prefix reuse; 0 = off
    decode_slots: int = 1  # in-process rows decoded together at a pinned shape (fingerprinted)
    prefill_process: bool = True  # S > 1: prefill in a process of its own (False: a thread)
    device_scope: bool = False
    watch: bool = True
    watch_interval: float = 2.0
    reload_wait: float = 30.0
    invalidation: InvalidationPolicy = InvalidationPolicy.PURGE
    digest_memo: str = dataclasses.field(default_factory=default_digest_memo)
    ttl: float | None = None
    api_keys: tuple[str, ...] = ()
    # Bound to loopback without keys: the Host names and browser origins accepted besides
    # the loopback ones ("*": any); see edge/origin.py.
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    cache_scope: str = "shared"
    # Under per-key scope: every key may reuse every key's saved prefix states (tenants who
    # trust each other); off, each key reuses only its own.
    shared_prefixes: bool = False
    admin_token: str = ""
    # Who may read /metrics and /status.json: "auto" is the admin token's holder when one is
    # set, else any API key's when keys are set, else everybody.
    status_access: str = "auto"
    max_in_flight: int = 1024
    max_connections: int = 1000
    # Of them, from one client address (loopback included: every local agent shares it).
    max_connections_per_peer: int = 256
    # Time bounds per connection: for a request's headers to be complete (after the
    # connection opens or its last response: slowloris and idle keep-alive alike), for its
    # body to arrive, and for a client to read what it is sent.
    idle_timeout: float = 15.0
    body_timeout: float = 10.0
    body_min_rate: float = 1024.0  # bytes a second a body must keep up once 1 s has passed
    max_body_connections: int = 64  # bodies arriving at once: past it the oldest is cut
    send_timeout: float = 30.0
    # The kernel's send buffer per client connection (SO_SNDBUF), 0: the kernel's own
    # (autotuned on Linux up to net.ipv4.tcp_wmem's maximum, 4 MB by default).
    send_buffer: int = 0
    store_retry: float = 2.0
    lock_ttl: float = 10.0
    lease_ttl: float = 30.0  # a replica's lease on the namespace it serves (renewed every third)
    supersede_grace: float = 60.0  # how long after its last replica a namespace is superseded
    replay: bool = False
    record_key: str = ""  # HMAC secret of recorded and exported lines ("": checksums only)
    upstream: tuple[str, ...] = ()  # mlx_lm.server URLs: generate there instead of in-process
    model_dir: str = ""  # with upstream: the model directory the upstreams serve
    upstream_timeout: float = 30.0
    log_format: str = "auto"
    log_level: str = "info"

    @property
    def status_readers(self) -> str:
        """`status_access` resolved: "admin", "api-key" or "public"."""
        if self.status_access != "auto":
            return self.status_access
        return "admin" if self.admin_token else "api-key" if self.api_keys else "public"

    @property
    def served_model_id(self) -> str:
        """The model name clients use: explicit, the demo's name, or the model as given
        (with several models: the first one's, unless --model-id names another)."""
        if self.model_id:
            return self.model_id
        if self.upstream:
            return self.upstream_pools[0].model_id
        return self.served_models[0][0]

    @property
    def served_models(self) -> tuple[tuple[str, str], ...]:
        """(id, model) of every model served in-process: `--model ID=PATH`, repeatable
        (comma-separated in CACHEPROXY_MODEL); a bare PATH is named by --model-id, else the
        demo's name for the bundled model, else the PATH itself."""
        return _named(self.model, "model", self.model_id)

    @property
    def upstream_pools(self) -> tuple[UpstreamPool, ...]:
        """The upstream pools, each tied to the model directory its mlx_lm.server processes
        serve: `--model-dir [ID=]DIR` (repeatable, as --model) and `--upstream [ID=]URL`
        (repeatable); with one directory a bare URL is its, with several each URL names
        the ID of its directory."""
        dirs = _named(self.model_dir, "model_dir", self.model_id)
        urls: dict[str, list[str]] = {name: [] for name, _ in dirs}
        for spec in self.upstream:
            bare = spec.startswith(("http://", "https://")) or "=" not in spec
            name, _, url = ("", "", spec) if bare else spec.partition("=")
            if not name and len(dirs) == 1:
                name = dirs[0][0]
            if name not in urls:
                raise ValueError(
                    f"invalid value for setting 'upstream': {spec!r} names no --model-dir"
                    if name else f"invalid value for setting 'upstream': {spec!r}: with "
                    "several --model-dir, give each upstream as ID=URL")
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"invalid value for setting 'upstream': {url!r} is not an "
                                 "http URL")
            urls[name].append(url)
        for name, directory in dirs:
            if not urls[name]:
                raise ValueError(f"--model-dir {name}={directory} has no --upstream "
                                 f"(give one as {name}=URL)")
        return tuple(UpstreamPool(name, directory, tuple(urls[name])) for name, directory in dirs)

    def model_for(self, model_id: str) -> str:
        """The model (path or repo) served as `model_id` (the first one if none is)."""
        served = self.served_models
        return next((model for name, model in served if name == model_id), served[0][1])


@dataclass(frozen=True, slots=True)
class UpstreamPool:
    """The mlx_lm.server processes that serve one model directory, as one model."""

    model_id: str
    model_dir: str
    urls: tuple[str, ...]


def _named(value: str, setting: str, model_id: str) -> tuple[tuple[str, str], ...]:
    """(id, path) of each `[ID=]PATH` in a comma-separated setting: a lone bare PATH is
    named by --model-id; any other bare PATH by the demo's name for the bundled model, else
    by the PATH itself."""
    specs = [_split(part.strip()) for part in value.split(",") if part.strip()]
    if len(specs) == 1 and not specs[0][0] and specs[0][1]:
        path = specs[0][1]
        return ((model_id or _default_name(path), path),)
    named = []
    for name, path in specs:
        if not path:
            raise ValueError(f"invalid value for setting '{setting}': {name + '='!r} (ID=PATH)")
        named.append((name or _default_name(path), path))
    return tuple(named)


def _split(spec: str) -> tuple[str, str]:
    """("ID", "PATH") of `ID=PATH`; ("", spec) of a bare path, which is also what a spec
    that starts as a path does (`/`, `~`, `.`): `/models/a=b` is a directory's name."""
    name, sep, path = spec.partition("=")
    if not sep or name.startswith(("/", "~", ".")):
        return "", spec
    return name, path


def _default_name(path: str) -> str:
    return DEMO_MODEL_ID if path == str(BUNDLED_MODEL) else path


def _convert(field: dataclasses.Field[Any], raw: object) -> object:
    kind = field.type if isinstance(field.type, str) else field.type.__name__
    if isinstance(raw, list) and kind == "str":  # a repeated flag (--model): as in the env
        return ",".join(raw)
    if not isinstance(raw, str):
        return tuple(raw) if isinstance(raw, list) else raw
    if kind.endswith(" | None"):
        if raw.strip().lower() in ("", "none"):
            return None
        kind = kind.removesuffix(" | None")
    if kind == "tuple[str, ...]":  # a comma-separated list in the environment
        return tuple(item.strip() for item in raw.split(",") if item.strip())
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "bool":
            return raw.strip().lower() in ("1", "true", "yes", "on")
        if kind == "SamplingMode":
            return SamplingMode(raw)
        if kind == "InvalidationPolicy":
            return InvalidationPolicy(raw)
    except ValueError as exc:
        raise ValueError(f"invalid value {raw!r} for setting '{field.name}': {exc}") from exc
    return raw


def build_settings(flags: Mapping[str, object], env: Mapping[str, str]) -> Settings:
    """Merge explicit flags (None = not given) over CACHEPROXY_* variables over defaults."""
    values: dict[str, object] = {}
    for field in dataclasses.fields(Settings):
        env_value = env.get(ENV_PREFIX + field.name.upper())
        flag_value = flags.get(field.name)
        chosen = flag_value if flag_value is not None else env_value
        if chosen is not None:
            values[field.name] = _convert(field, chosen)
    settings = Settings(**values)  # type: ignore[arg-type]
    validate(settings)
    return settings


def validate(settings: Settings) -> None:
    """Reject settings that cannot work, with a message naming the setting."""
    checks = {
        "port": 0 <= settings.port <= 65535,
        "queue_size": settings.queue_size >= 1,
        "generation_timeout": settings.generation_timeout > 0,
        "watch_interval": settings.watch_interval > 0,
        "reload_wait": settings.reload_wait > 0,
        "max_body_bytes": settings.max_body_bytes >= 1024,
        "default_max_tokens": 1 <= settings.default_max_tokens <= settings.max_tokens_cap,
        "log_format": settings.log_format in ("auto", "json", "console"),
        "ttl": settings.ttl is None or settings.ttl > 0,
        "cache_scope": settings.cache_scope in ("shared", "per-key"),
        "status_access": settings.status_access in ("auto", "admin", "api-key", "public"),
        "max_in_flight": settings.max_in_flight >= 1,
        "max_connections": settings.max_connections >= 1,
        "max_connections_per_peer": settings.max_connections_per_peer >= 1,
        "max_answer_tokens": settings.max_answer_tokens >= 1,
        "idle_timeout": settings.idle_timeout > 0,
        "body_timeout": settings.body_timeout > 0,
        "body_min_rate": settings.body_min_rate >= 0,
        "max_body_connections": settings.max_body_connections >= 1,
        "send_timeout": settings.send_timeout > 0,
        "send_buffer": settings.send_buffer >= 0,
        "store_retry": settings.store_retry > 0,
        "lock_ttl": settings.lock_ttl > 0,
        "lease_ttl": settings.lease_ttl > 0,
        "supersede_grace": settings.supersede_grace >= 0,
        "upstream_timeout": settings.upstream_timeout > 0,
        "prefill_step": settings.prefill_step >= 1,
        "max_schema_bytes": settings.max_schema_bytes >= 1,
        "max_schema_properties": settings.max_schema_properties >= 1,
        "max_enum_values": settings.max_enum_values >= 1,
        "max_tools": settings.max_tools >= 1,
        "max_schema_depth": settings.max_schema_depth >= 1,
        "schema_timeout": settings.schema_timeout > 0,
        "prefix_cache_bytes": settings.prefix_cache_bytes >= 0,
        "decode_slots": 1 <= settings.decode_slots <= 256,
    }
    if settings.status_access == "admin" and not settings.admin_token:
        raise ValueError("--status-access admin needs CACHEPROXY_ADMIN_TOKEN")
    if settings.status_access == "api-key" and not settings.api_keys:
        raise ValueError("--status-access api-key needs --api-key")
    served = settings.served_models
    if len({name for name, _ in served}) != len(served):
        raise ValueError("invalid value for setting 'model': two models with one id")
    if settings.upstream and not settings.model_dir:
        raise ValueError("--upstream needs --model-dir: the model directory the upstream serves")
    if settings.upstream and settings.decode_slots != 1:
        raise ValueError("--decode-slots is for the in-process runner; upstream mode sends one "
                         "generation at a time to each upstream")
    if settings.model_dir and not settings.upstream:
        raise ValueError("--model-dir is for --upstream; the in-process runner takes --model")
    names = [pool.model_id for pool in settings.upstream_pools] if settings.upstream else \
        [name for name, _ in served]
    if settings.model_id and settings.model_id not in names:
        raise ValueError(f"--model-id {settings.model_id!r} names none of the models served "
                         f"({', '.join(names)})")
    if settings.upstream:
        if len(served) > 1 or settings.model != str(BUNDLED_MODEL):
            raise ValueError("--model is for the in-process runner; upstream mode serves the "
                             "models of --model-dir (repeat it as ID=DIR for several)")
        pools = settings.upstream_pools  # (raises on a URL that names no directory)
        if len({pool.model_id for pool in pools}) != len(pools):
            raise ValueError("invalid value for setting 'model_dir': two models with one id")
    for name, ok in checks.items():
        if not ok:
            raise ValueError(f"invalid value for setting '{name}': {getattr(settings, name)!r}")
