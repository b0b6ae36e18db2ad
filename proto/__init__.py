"""Wire contract: the .proto files under ``kvtier/v1`` and their generated stubs.

The tier names live in ``kvtier.tiers.vocab`` (``Tier`` carries the wire enum's values).

Regenerate with ``python scripts/gen_proto.py`` (pinned grpcio-tools, see pyproject);
``tests/test_proto.py`` fails when the committed stubs are stale.
"""

from kvtier.proto.kvtier.v1 import locations_pb2 as locations_pb2
from kvtier.proto.kvtier.v1 import locations_pb2_grpc as locations_pb2_grpc
from kvtier.proto.kvtier.v1 import node_pb2 as node_pb2
from kvtier.proto.kvtier.v1 import node_pb2_grpc as node_pb2_grpc
from kvtier.proto.kvtier.v1 import peer_pb2 as peer_pb2
from kvtier.proto.kvtier.v1 import peer_pb2_grpc as peer_pb2_grpc
from kvtier.proto.kvtier.v1 import router_pb2 as router_pb2
from kvtier.proto.kvtier.v1 import router_pb2_grpc as router_pb2_grpc
from kvtier.proto.kvtier.v1 import transfer_pb2 as transfer_pb2
from kvtier.proto.kvtier.v1 import transfer_pb2_grpc as transfer_pb2_grpc

__all__ = ["locations_pb2", "locations_pb2_grpc", "node_pb2", "node_pb2_grpc", "peer_pb2", "peer_pb2_grpc",
           "router_pb2", "router_pb2_grpc",
           "transfer_pb2", "transfer_pb2_grpc"]
