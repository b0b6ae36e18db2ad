"""The daemon's service layer: the gRPC servicers and the conversions to and from the wire.

The only daemon modules that import ``kvtier.proto`` are in this package:

* :mod:`~kvtier.daemon.services.node`: ``kvtier.v1.Node`` (:class:`NodeService`);
* :mod:`~kvtier.daemon.services.locations`: ``kvtier.v1.Locations`` (:class:`LocationsService`);
* :mod:`~kvtier.daemon.services.transfer`: ``kvtier.v1.Transfer`` (:class:`TransferService`);
* :mod:`~kvtier.daemon.services.convert`: domain values <-> messages;
* :mod:`~kvtier.daemon.services.handlers`: errors answered with a status, and timing;
* this module: :func:`add_services`, which registers them, gRPC health and reflection on a server.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvtier.daemon.services.locations import LocationsService
from kvtier.daemon.services.node import NodeService
from kvtier.daemon.services.transfer import TransferService
from kvtier.proto import (
    locations_pb2,
    locations_pb2_grpc,
    node_pb2,
    node_pb2_grpc,
    transfer_pb2,
    transfer_pb2_grpc,
)

SERVICE_NAMES = (node_pb2.DESCRIPTOR.services_by_name["Node"].full_name,
                 locations_pb2.DESCRIPTOR.services_by_name["Locations"].full_name,
                 transfer_pb2.DESCRIPTOR.services_by_name["Transfer"].full_name)


def add_services(server: grpc.aio.Server, node: NodeService, locations: LocationsService,
                 transfer: TransferService) -> health.aio.HealthServicer:
    """Register the three servicers, health checking and reflection; returns the health
    servicer (every service starts NOT_SERVING until :func:`set_serving`)."""
    node_pb2_grpc.add_NodeServicer_to_server(node, server)
    locations_pb2_grpc.add_LocationsServicer_to_server(locations, server)
    transfer_pb2_grpc.add_TransferServicer_to_server(transfer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer) -> None:
    """Mark the server and each service SERVING."""
    for svc in ("", *SERVICE_NAMES):
        await health_servicer.set(svc, health_pb2.HealthCheckResponse.SERVING)


__all__ = ["LocationsService", "NodeService", "SERVICE_NAMES", "TransferService", "add_services", "set_serving"]
