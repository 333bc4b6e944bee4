"""Settings of one node daemon (``syncd --run-id RUN ...``); the CLI fills them from flags and ``SYNCD_*``
variables (README: "Flags and environment variables")."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class EngineSpec:
    """An engine the daemon keeps current: ``name`` (metrics label) and its control ``url``
    (``http://host:port`` of an engine process, see ``syncd.engine.control``)."""

    name: str
    url: str

    @classmethod
    def parse(cls, text: str, index: int) -> "EngineSpec":
        """``NAME=URL`` or a bare ``URL`` (named ``engine<index>``); raises ``ValueError``."""
        name, sep, url = text.partition("=")
        if not sep:
            name, url = f"engine{index}", text
        name, url = name.strip(), url.strip()
        if not name or not url.startswith("http://"):
            raise ValueError(f"--engine {text!r}: expected [NAME=]http://HOST:PORT")
        return cls(name, url)


@dataclass(frozen=True)
class DaemonConfig:
    """What the daemon does and how often. Times in seconds, sizes in bytes.

    ``poll_interval_s`` between conditional GETs of ``latest.json`` (each waits ``±poll_jitter`` of it at
    random); after a store error the wait doubles per failure up to ``backoff_max_s``. Every
    ``list_every_s`` the version listing is read too (a hint that lags is caught). ``engine_check_s``:
    how often each engine's version is asked (a restarted engine is noticed within that).
    ``download_concurrency``: shards downloaded at once. ``cache_dir`` / ``cache_max_bytes``: the node's
    shard cache. ``metrics_port``: Prometheus on ``metrics_addr`` (None: off; 0: a free port).
    ``status_file``: where the node state is written for ``syncd status`` (None: in the cache dir).
    ``retry_failed_s``: how long a version that failed verification is left alone before another try.
    ``engine_lease_s``: the lease this daemon holds on each engine process (renewed every engine check; a
    daemon that dies frees its engines that long after). ``engine_scrub_bytes``: weight bytes of each engine
    checksummed against the manifest per scrub (0: none; see ``docs/engine.md``), at most one scrub per engine
    every ``engine_scrub_s`` (made by the first engine check after it is due): a scrub is a call into the engine,
    and a vLLM worker busy-polls a core for 1 s after each call that reaches it (docs/dynamo.md).
    ``engine_token_file``: the node's engine-control token (None: ``syncd.engine_token.token_path``).
    """

    run_id: str
    store_url: str | None = None
    engines: tuple[EngineSpec, ...] = ()
    cache_dir: Path | None = None
    cache_max_bytes: int = 16 << 30
    poll_interval_s: float = 0.5
    poll_jitter: float = 0.2
    backoff_max_s: float = 10.0
    list_every_s: float = 30.0
    engine_check_s: float = 1.0
    download_concurrency: int = 8
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    status_file: Path | None = None
    retry_failed_s: float = 60.0
    store_options: dict = field(default_factory=dict)
    store_endpoint: str | None = None
    engine_lease_s: float = 10.0
    engine_scrub_bytes: int = 640 << 20
    engine_scrub_s: float = 10.0
    engine_token_file: Path | None = None

    def __post_init__(self):
        if self.poll_interval_s <= 0 or self.engine_check_s <= 0:
            raise ValueError("poll and engine-check intervals must be positive")
        if not 0 <= self.poll_jitter < 1:
            raise ValueError("poll jitter is a fraction in [0, 1)")
        if self.backoff_max_s < self.poll_interval_s:
            raise ValueError("backoff maximum must be at least the poll interval")
        if not 2 * self.engine_check_s <= self.engine_lease_s <= 300:
            raise ValueError(f"engine lease ({self.engine_lease_s:g}s) must be at least two engine checks "
                             f"({2 * self.engine_check_s:g}s) and at most 300s")
        if self.engine_scrub_bytes < 0:
            raise ValueError("engine scrub bytes must not be negative")
        if not self.engine_scrub_s > 0:
            raise ValueError(f"engine scrub interval must be positive, got {self.engine_scrub_s:g}s")
        if self.download_concurrency < 1:
            raise ValueError("download concurrency must be at least 1")
        names = [e.name for e in self.engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique: {names}")
