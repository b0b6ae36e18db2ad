"""What the daemon's ``--tcp`` listener serves: only what remote parties need.

gRPC serves every service registered on a server on each of its ports, so the TCP listener is a
server of its own, with: health checking and ``Locations`` (the location feed routers follow);
with ``--tcp-services all`` also ``Node`` and ``Transfer`` (remote engines); with ``--peer-serve``
also ``Peer`` (other daemons fetch blocks: :mod:`kvtier.daemon.services.peer`). No reflection.
The servicers are the unix server's own instances (one store, one authenticator).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from kvtier.daemon.services.locations import LocationsService
from kvtier.daemon.services.node import NodeService
from kvtier.daemon.services.peer import PeerService, add_peer_service
from kvtier.daemon.services.transfer import TransferService
from kvtier.proto import locations_pb2_grpc, node_pb2_grpc, transfer_pb2_grpc

TCP_SERVICES = ("locations", "all")


def add_tcp_services(server: grpc.aio.Server, which: str, health_servicer: health.aio.HealthServicer,
                     node: NodeService, locations: LocationsService, transfer: TransferService,
                     peer: PeerService | None = None) -> None:
    """Register on the TCP ``server`` what ``which`` (--tcp-services) names, and ``peer``
    (--peer-serve) when given."""
    if which not in TCP_SERVICES:
        raise ValueError(f"--tcp-services {which!r} is not {' or '.join(TCP_SERVICES)}")
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    locations_pb2_grpc.add_LocationsServicer_to_server(locations, server)
    if which == "all":
        node_pb2_grpc.add_NodeServicer_to_server(node, server)
        transfer_pb2_grpc.add_TransferServicer_to_server(transfer, server)
    if peer is not None:
        add_peer_service(server, peer)
