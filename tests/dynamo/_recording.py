"""One recording node for the tests that need real serving: the Dynamo frontend and one reference-engine worker
serving a model folder as version 0 and recording its replay records into a file store, and optionally a sandbox
proxy process in front of it recording the trajectories."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path


@contextmanager
def recording_node(root, model, run_id: str, prefix: str, *, sandbox: str | None = None):
    """Start the node for ``model`` under ``root`` (the store is ``root/store``, created) and, with ``sandbox``, a
    proxy process for that sandbox id. Yields ``(node, its NodeConfig, store URL, proxy URL or None)``; stops
    everything on exit."""
    from syncd.engine.dynamo.node import Node, NodeConfig
    from syncd.engine.proxy.procs import start_proxy
    from syncd.procs import stop_process

    store = Path(root) / "store"
    store.mkdir()
    cfg = NodeConfig.recording(model, root, store_url=store.as_uri(), run_id=run_id, prefix=prefix)
    node = Node(cfg).start()
    proxy = None
    try:
        url = None
        if sandbox is not None:
            proxy, url = start_proxy(root, node.frontend_url, store.as_uri(), run_id, sandbox)
        yield node, cfg, store.as_uri(), url
    finally:
        if proxy is not None:
            stop_process(proxy, 10)
        node.close()
