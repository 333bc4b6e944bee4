"""The node daemon as one node of a cluster (``syncd --run-id RUN --cluster-rank R --cluster-peers ...``).

In cluster mode the daemon does not poll the store itself: a :class:`~syncd.cluster.ClusterNode` runs in the
daemon's event loop (its elected controller polls), gets every version's shards into the node cache -- each
shard read from the store by one node of the cluster, then broadcast between the nodes -- and hands each
version, in order, to :meth:`NodeDaemon.on_version_ready <syncd.daemon.NodeDaemon.on_version_ready>`. The
daemon then stages and applies it as usual; its :class:`~syncd.daemon.fetcher.StoreShardSource` finds the
shards already in the cache and reads from the store only a shard that is missing (a documented fallback,
counted in ``syncd_fetched_bytes_total``). See ``docs/cluster.md``.

* :func:`add_cluster_flags` adds ``--cluster-<flag>`` to the ``syncd`` command line for every flag of
  ``python -m syncd.cluster.node`` (:func:`syncd.cluster.cli.build_parser`) except the store, run, cache and
  key settings the daemon already has; :func:`cluster_settings` turns them (over ``SYNCD_CLUSTER_*``
  variables, which the node's parser reads) into :class:`ClusterSettings`, or None when no rank is set.
* :class:`ClusterLink` is the companion the daemon runs (:meth:`NodeDaemon.attach
  <syncd.daemon.NodeDaemon.attach>`): on start it asks the engines their versions and passes the lowest as
  the node's ``delivered`` (so a restart neither repeats nor skips a version; an engine without weights
  makes it :data:`~syncd.cluster.config.NO_HISTORY`: start at the newest full version); it stops the node
  after the daemon's loop has ended (never mid-apply); it exposes the node's counters as ``syncd_cluster_*``
  Prometheus metrics in the daemon's registry and as ``"cluster"`` in the status file.

Thread-safety: :class:`ClusterLink` lives on the daemon's event loop; the metrics collector (scraped from the
metrics server's thread) reads a snapshot the link refreshes on the loop.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: flags of ``python -m syncd.cluster.node`` that the daemon has under its own names
_SHARED = {"help", "store", "endpoint", "store_option", "run_id", "cache_root", "signing_key_file", "log_level"}
_METAVAR = {"rank": "R", "peers": "R=HOST:PORT,...", "peers-from-store": "ID", "advertise": "HOST:PORT",
            "etcd": "URL", "listen": "HOST:PORT", "secret-file": "PATH", "events": "PATH", "slow-fraction": "F",
            "throttle-bps": "BYTES_PER_S"}
_HELP = {  # where the node's own parser has none (its defaults: syncd.cluster.ClusterConfig)
    "rank": "this node's rank in the cluster; setting it runs the daemon in cluster mode",
    "heartbeat-s": "seconds between heartbeats to every member (default 1)",
    "dead-after-s": "a member not heard from for this long is dead (default 3 heartbeats)",
    "poll-s": "seconds between the controller's polls of the store for new versions (default 1)",
    "discover-s": "seconds between reads of the store directory of members (default 10)",
    "fanout": "children per node in each shard's broadcast tree (default 2)",
    "chunk-bytes": "unit of hashing, verifying and forwarding (default 1 MiB)",
    "store-streams": "shards read from the store at once, cluster-wide (default 0: every root at once)",
    "pull-window": "shards this node pulls from peers at once (default 16)",
    "stall-s": "a source that sends no chunk for this long is left for another (default 5)",
    "store-fallback-s": "with no live source for this long, read the rest of a shard from the store (default 30)",
    "pace-timeout-s": "a root stops waiting for earlier shards' store reads after this long (default 10)",
    "slow-fraction": "a node its children receive from below this fraction of the median rate is moved to the "
                     "leaves (default 0.2)",
    "throttle-bps": "cap this node's upload to peers (tests, benchmarks)",
    "etcd-ttl-s": "this node's etcd lease in whole seconds, with --cluster-etcd (default 5, at least 2): a dead "
                  "controller is replaced about that long after its last keepalive",
    "no-fsync": "do not fsync shards before they enter the cache (tests)",
}
DEST_PREFIX = "cluster__"


def _node_parser() -> argparse.ArgumentParser:
    from syncd.cluster.cli import build_parser

    parser = build_parser()
    parser.exit_on_error = False
    return parser


def _cluster_actions(parser: argparse.ArgumentParser):
    """``(action, name)`` for each node flag the daemon takes as ``--cluster-<name>``."""
    for action in parser._actions:  # noqa: SLF001 -- argparse has no public way to list a parser's flags
        if action.dest in _SHARED or not action.option_strings:
            continue
        yield action, action.option_strings[0][2:].removeprefix("cluster-")


def env_var(name: str) -> str:
    """The variable of flag ``--cluster-<name>`` (``SYNCD_CLUSTER_<NAME>``)."""
    return "SYNCD_CLUSTER_" + name.upper().replace("-", "_")


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--cluster-<flag>`` for every flag of the cluster node process (unset ones stay absent, so
    :func:`cluster_settings` can fall back to the ``SYNCD_CLUSTER_*`` variables)."""
    group = parser.add_argument_group("cluster mode (docs/cluster.md; each flag also as SYNCD_CLUSTER_<FLAG>)")
    for action, name in _cluster_actions(_node_parser()):
        help_text = _HELP.get(name) or action.help or "see docs/cluster.md"
        kw = {"dest": DEST_PREFIX + action.dest, "default": argparse.SUPPRESS,
              "help": f"{help_text} [{env_var(name)}]"}
        if action.nargs == 0:
            kw["action"] = "store_true"
        else:
            kw["type"] = action.type
            kw["metavar"] = _METAVAR.get(name) or ("S" if name.endswith("-s") else "N")
        group.add_argument("--cluster-" + name, **kw)


@dataclass
class ClusterSettings:
    """What the daemon needs to run its cluster node: the node's :class:`~syncd.cluster.ClusterConfig`,
    the cluster secret, and an optional JSON-lines event log path (tests, benchmarks)."""

    config: object
    secret: object
    events: str | None = None


def cluster_settings(args: argparse.Namespace) -> ClusterSettings | None:
    """The cluster settings of a parsed ``syncd`` command line (flags over ``SYNCD_CLUSTER_*``), or None if
    no rank is set (not in cluster mode). Raises ``ValueError`` saying what is wrong: members given without
    a rank, a rank without members, a rank missing from the static list, a bad value, no cluster secret."""
    from syncd.cluster.auth import ClusterSecret
    from syncd.cluster.cli import config_from_args

    parser = _node_parser()
    try:
        ns = parser.parse_args([])  # every value from SYNCD_CLUSTER_* (or the node's defaults)
    except argparse.ArgumentError as exc:
        flag = (exc.argument_name or "").split("/")[0].strip()
        name = next((n for a, n in _cluster_actions(parser) if flag in a.option_strings), None)
        var = env_var(name) if name else "a SYNCD_CLUSTER_* variable"
        raise ValueError(f"{var}={os.environ.get(var, '')!r} is not valid: {exc.message}") from None
    for action, _ in _cluster_actions(parser):
        if hasattr(args, DEST_PREFIX + action.dest):
            setattr(ns, action.dest, getattr(args, DEST_PREFIX + action.dest))
    if ns.rank is None:
        if ns.peers or ns.cluster_id:
            raise ValueError("cluster members are given but no rank: set --cluster-rank (or SYNCD_CLUSTER_RANK)")
        return None
    if not ns.peers and not ns.cluster_id and not ns.etcd:
        raise ValueError("cluster mode (--cluster-rank) needs the members: --cluster-peers R=HOST:PORT,..., "
                         "--cluster-peers-from-store ID or --cluster-etcd URL (or SYNCD_CLUSTER_PEERS / "
                         "SYNCD_CLUSTER_PEERS_FROM_STORE / SYNCD_CLUSTER_ETCD)")
    try:
        config = config_from_args(ns)
    except ValueError as exc:
        raise ValueError(f"cluster settings: {exc}") from None
    if config.peers is not None and config.rank not in config.peers and config.advertise is None:
        raise ValueError(f"--cluster-rank {config.rank} is not in --cluster-peers (ranks {sorted(config.peers)})")
    secret = (ClusterSecret.from_file(ns.cluster_secret_file) if ns.cluster_secret_file
              else ClusterSecret.from_env())
    if secret is None:
        raise ValueError("cluster mode needs the cluster secret: SYNCD_CLUSTER_SECRET, SYNCD_CLUSTER_SECRET_FILE "
                         "or --cluster-secret-file")
    return ClusterSettings(config=config, secret=secret, events=ns.events)


class ClusterLink:
    """Runs a :class:`~syncd.cluster.ClusterNode` for ``daemon`` (a :class:`~syncd.daemon.NodeDaemon`
    made with ``poll=False``) in the daemon's loop; see the module docstring. ``store``: the
    :class:`~syncd.store.Store` the node reads (the daemon's). Attach with ``daemon.attach(link)``; the
    daemon calls :meth:`start`, :meth:`status` and :meth:`stop`."""

    def __init__(self, daemon, settings: ClusterSettings, *, store):
        self.daemon, self.settings, self.store = daemon, settings, store
        self.node = None
        self.snapshot: dict | None = None
        daemon.metrics.registry.register(_ClusterCollector(self))

    async def start(self) -> None:
        """Ask the engines their versions, then start the node (listening once this returns). Raises
        ``OSError`` if the cluster address cannot be bound."""
        from syncd.cluster.config import NO_HISTORY
        from syncd.cluster.node import ClusterNode

        delivered = await self._engines_version()
        key = self.daemon.key if self.daemon.key is not None else False
        self.node = ClusterNode(self.store, self.daemon.run_id, secret=self.settings.secret,
                                cache_root=self.daemon.cache.root, config=self.settings.config, signing_key=key,
                                on_version_ready=self._deliver, delivered=delivered, events=self.settings.events,
                                failures=self.daemon.metrics.failure)
        await self.node.start()
        self.snapshot = self.node.summary()
        self.daemon.supervisor.spawn("cluster_status", self._refresh_loop, kind="cluster_status")
        if delivered != NO_HISTORY:
            await self._known(delivered)

    async def stop(self) -> None:
        """Stop the node (idempotent). The daemon calls it after its loop ended (and its supervisor stopped
        the status refresher), so never mid-apply."""
        if self.node is not None:
            await self.node.stop()
            self.snapshot = self.node.summary()
            log.info("cluster node %d stopped", self.node.rank)

    def status(self) -> dict:
        """Fields for the daemon's status file: ``{"cluster": ClusterNode.summary()}``."""
        if self.node is None:
            return {}
        self.snapshot = self.node.summary()
        return {"cluster": self.snapshot}

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.settings.config.heartbeat_s))
            self.snapshot = self.node.summary()

    async def _engines_version(self) -> int:
        """The lowest version of the engines, or NO_HISTORY if one has no version or does not answer."""
        from syncd.cluster.config import NO_HISTORY

        async def ask(driver):
            try:
                return await asyncio.to_thread(lambda: driver.adapter.version)
            except Exception as exc:  # noqa: BLE001 -- unreachable or failing: no history to rely on
                log.warning("cluster: engine %s did not say its version (%s: %s)", driver.name,
                            type(exc).__name__, exc)
                return None

        versions = await asyncio.gather(*(ask(d) for d in self.daemon.drivers.values()))
        if all(isinstance(v, int) for v in versions):
            log.info("cluster: engines at versions %s; the node continues after version %d", versions, min(versions))
            return min(versions)
        log.info("cluster: engines at versions %s; the node starts at the newest full version", versions)
        return NO_HISTORY

    async def _known(self, version: int) -> None:
        """Tell the daemon that ``version`` (the engines' own) exists, so an engine found without valid
        weights is rebuilt now rather than at the next version."""
        from syncd.errors import SyncdError

        try:
            raw = await asyncio.to_thread(self.daemon.manifests.raw, version)
            await self.daemon.on_version_ready(raw)
        except (SyncdError, OSError) as exc:
            log.warning("cluster: the engines' version %d cannot be verified now: %s", version, exc)

    async def _deliver(self, manifest) -> None:
        raw = self.node.manifest_bytes(manifest.version)
        await self.daemon.on_version_ready(raw if raw is not None else manifest)


class _ClusterCollector:
    """``syncd_cluster_*`` metrics from the link's latest snapshot (nothing before the node started)."""

    def __init__(self, link: ClusterLink):
        self.link = link

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.link.snapshot
        if s is None:
            return
        gauges = (("rank", "This node's rank in the cluster", s["rank"]),
                  ("term", "Highest controller term seen (each takeover opens a new term)", s["term"]),
                  ("is_controller", "1 while this node is the cluster's controller", int(s["is_controller"])),
                  ("controller_rank", "The controller's rank as seen here (-1: none yet)",
                   -1 if s["controller"] is None else s["controller"]),
                  ("live_members", "Members heard from within dead-after, this node included", len(s["live"])),
                  ("delivered_version", "Newest version the cluster layer handed to the daemon (-1: none)",
                   -1 if s["delivered"] is None else s["delivered"]))
        for name, doc, value in gauges:
            yield GaugeMetricFamily("syncd_cluster_" + name, doc, value=value)
        received = CounterMetricFamily("syncd_cluster_received_bytes",
                                       "Shard bytes this node received, by source: peers (tree broadcast) or "
                                       "the store (shards it is root of, or a last-resort fallback)",
                                       labels=["source"])
        received.add_metric(["peers"], s["received_bytes"])
        received.add_metric(["store"], s["store_bytes"])
        yield received
        counters = (("refused_connections", "Connections refused: failed authentication or not the protocol",
                     "refused_connections"),
                    ("bad_frames", "Authenticated connections closed for a malformed or forged frame", "bad_frames"),
                    ("received_chunks", "Chunks received from peers (each checked against its tag)",
                     "received_chunks"),
                    ("served_bytes", "Shard bytes sent to peers", "served_bytes"),
                    ("served_chunks", "Chunks sent to peers", "served_chunks"),
                    ("relays_lost", "Pulls whose source (a relay or root) died, stalled or failed, resumed from "
                                    "another source", "relays_lost"),
                    ("peer_restarts", "Peers seen coming back as a new incarnation", "peer_restarts"))
        for name, doc, field in counters:
            yield CounterMetricFamily("syncd_cluster_" + name, doc, value=s[field])
