"""The router's side, one concern a module: ``feed`` (the daemons' location streams, DNS),
``vllm_events`` (vLLM engines' own KV event publishers, folded into the same index),
``index`` (their fold: which leading blocks each worker holds in each tier), ``scoring`` (the
tier weights, the cost and the order), ``loads`` (what the router dispatched), ``router`` (the
:class:`~kvtier.client.routing.router.Router` that puts them together) and ``route_server``
(``kvtier route-server``: the router as a gRPC service)."""
