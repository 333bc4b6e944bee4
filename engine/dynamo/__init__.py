"""NVIDIA Dynamo integration: any ``engine.Adapter`` + ``engine.Generator`` engine served as a Dynamo worker.

* ``engine.dynamo.worker``: :class:`~engine.dynamo.worker.DynamoWorker` and ``python -m engine.dynamo.worker``
  (registration with the frontend, token streaming with each token's weight version, the weight-update admin
  routes ``/engine/weights/<op>`` on the worker's system port, deregistration on SIGTERM);
* ``engine.dynamo.frontend``: the OpenAI frontend (``python -m engine.dynamo.frontend``, request migration);
* ``engine.dynamo.serve``: start and supervise a node's workers and frontend (``syncd serve``);
* ``engine.dynamo.protocol``: the request/response format between frontend and worker;
* ``engine.dynamo.settings``: discovery (``file`` or ``etcd`` + NATS) and bind addresses;
* ``engine.dynamo.services``: local etcd and NATS servers.

Needs ``ai-dynamo-runtime`` (imported only where a runtime is started). See ``docs/dynamo.md``."""
