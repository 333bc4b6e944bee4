"""NVIDIA Dynamo integration: any ``syncd.engines.Adapter`` + ``syncd.engines.Generator`` engine served as a Dynamo worker.

* ``syncd.engine.dynamo.worker``: :class:`~syncd.engine.dynamo.worker.DynamoWorker` and ``python -m syncd.engine.dynamo.worker``
  (registration with the frontend, token streaming with each token's weight version, the weight-update admin
  routes ``/engine/weights/<op>`` on the worker's system port, deregistration on SIGTERM);
* ``syncd.engine.dynamo.frontend``: the OpenAI frontend (``python -m syncd.engine.dynamo.frontend``, request migration);
* ``syncd.engine.dynamo.serve``: start and supervise a node's workers and frontend (``syncd serve``);
* ``syncd.engine.dynamo.protocol``: the request/response format between frontend and worker;
* ``syncd.engine.dynamo.settings``: discovery (``file`` or ``etcd`` + NATS) and bind addresses;
* ``syncd.engine.dynamo.services``: local etcd and NATS servers.

Needs ``ai-dynamo-runtime`` (imported only where a runtime is started). See ``docs/dynamo.md``."""
