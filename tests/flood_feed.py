"""A location feed that floods: serves ``kvtier.v1.Locations`` on 127.0.0.1:PORT in plaintext and
sends a subscriber host-tier events as fast as its stream takes them (the protocol as kvtierd
speaks it: NodeInfo, a snapshot of what it holds, then event batches of consecutive seqs; it
keeps no ring, so every subscription starts from a snapshot).

    python tests/flood_feed.py PORT [NODE_ID]    # prints "listening PORT" once it serves

Each event stores a run of 256 new 16-byte keys; past 65,536 keys held, the oldest run is
removed in the same batch. A batch holds 32 events (8,192 keys stored).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import sys

import grpc

from kvtier.proto import locations_pb2 as L
from kvtier.proto import locations_pb2_grpc, node_pb2

RUN = 256
HELD = 65536
BATCH_EVENTS = 32
FP = bytes(range(16))
HOST = node_pb2.Tier.Value("TIER_HOST")


class Flood(locations_pb2_grpc.LocationsServicer):
    def __init__(self, node: str) -> None:
        self.node = node
        self.epoch = 7
        self.seq = 0
        self.runs: collections.deque[list[bytes]] = collections.deque()
        self.made = 0

    def _run(self) -> list[bytes]:
        out = [hashlib.blake2b(f"{self.node}/{self.made + i}".encode(), digest_size=16).digest() for i in range(RUN)]
        self.made += RUN
        return out

    def _batch(self) -> L.EventBatch:
        events = []
        for _ in range(BATCH_EVENTS):
            keys = self._run()
            self.seq += 1
            events.append(L.LocationEvent(seq=self.seq, kind=L.STORED, tier=HOST, fingerprint=FP, keys=keys))
            self.runs.append(keys)
            if len(self.runs) * RUN > HELD:
                self.seq += 1
                events.append(L.LocationEvent(seq=self.seq, kind=L.REMOVED, tier=HOST, fingerprint=FP,
                                              keys=self.runs.popleft()))
        return L.EventBatch(events=events, head_seq=self.seq)

    async def WatchLocations(self, request, context):  # noqa: N802, ANN001, ANN201
        yield L.WatchLocationsReply(epoch=self.epoch, node=L.NodeInfo(
            node_id=self.node, epoch=self.epoch, head_seq=self.seq,
            tiers=[L.TierInfo(tier=HOST, capacity_bytes=1 << 40, load_gbps=10.0)]))
        held = [k for run in self.runs for k in run]
        parts = [held[i:i + 4096] for i in range(0, len(held), 4096)] or [[]]
        for i, keys in enumerate(parts):
            entries = [L.LocationEvent(seq=self.seq, kind=L.STORED, tier=HOST, fingerprint=FP, keys=keys)] if keys \
                else []
            yield L.WatchLocationsReply(epoch=self.epoch, snapshot=L.SnapshotPart(
                at_seq=self.seq, first=i == 0, last=i == len(parts) - 1, entries=entries))
        while True:
            yield L.WatchLocationsReply(epoch=self.epoch, events=self._batch())
            await asyncio.sleep(0)


async def main(port: int, node: str) -> None:
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
    locations_pb2_grpc.add_LocationsServicer_to_server(Flood(node), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"listening {bound}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "F"))
