"""A location index's state in the earlier format (``key_lengths``, ``key_bytes``, the live rows'
bits), as routers saved it before the key table was saved as its arrays: what
``LocationIndex.load_state`` rebuilds from (``--state-path`` files of such routers)."""

from __future__ import annotations

import json

import numpy as np

from kvtier.client.routing.index import ALWAYS, LocationIndex


def earlier_format_state(index: LocationIndex) -> dict[str, np.ndarray]:
    hw = index._high
    live = np.flatnonzero(index._bits[:hw, ALWAYS >> 6] & np.uint64(1 << ALWAYS))
    keys = [index._rows.key(r) for r in live.tolist()]
    lengths = np.array([len(k) for k in keys], dtype=np.uint32 if any(len(k) > 255 for k in keys) else np.uint8)
    cols = sorted(index._columns.items(), key=lambda kv: kv[1])
    meta = {
        "columns": [[n, t, w, fp.hex(), c] for (n, t, w, fp), c in cols],
        "nodes": {nid: {"epoch": v.epoch, "seq": v.seq, "load_gbps": v.load_gbps, "capacity_bytes": v.capacity_bytes,
                        "workers": {w: [f.hex() for f in fps] for w, fps in v.workers.items()},
                        "fingerprints": sorted(f.hex() for f in v.fingerprints)}
                  for nid, v in index.nodes.items()},
    }
    bits = index._bits[live]
    mask = np.zeros(bits.shape[1], dtype=np.uint64)
    for cols2 in index._spec_cols.values():
        for c in cols2:
            mask[c >> 6] |= np.uint64(1 << (c & 63))
    for word, m in index._stale.items():
        mask[word] |= np.uint64(m)
    bits &= ~mask
    return {"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), "key_lengths": lengths,
            "key_bytes": np.frombuffer(b"".join(keys), dtype=np.uint8), "bits": bits}
