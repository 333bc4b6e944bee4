"""Simulated clusters for benchmarks and tests (lab code: it lives here, not in the product package): network
namespaces with shaped links (:mod:`bench.netsim.netns`), a read-only S3 endpoint over a file store that counts
the bytes it sends (:mod:`bench.netsim.s3`, ``python -m bench.netsim s3serve``), and cluster node processes
(:mod:`bench.netsim.nodes`). Moved from ``syncd.cluster.sim``.
"""

from bench.netsim.netns import Netns, free_port, netns_available
from bench.netsim.nodes import NodeProcs
from bench.netsim.s3 import S3FileServer, read_store_log, s3_env

__all__ = ["Netns", "NodeProcs", "S3FileServer", "free_port", "netns_available", "read_store_log", "s3_env"]
