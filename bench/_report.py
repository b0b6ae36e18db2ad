"""What every benchmark ends with: its result as one JSON object on the last line of stdout,
and the same line in ``--out FILE`` when given (the project's benchmark convention)."""

from __future__ import annotations

import json


def emit(result: dict, out: str | None = None, sort_keys: bool = False) -> None:
    line = json.dumps(result, sort_keys=sort_keys)
    if out:
        with open(out, "w") as fh:
            fh.write(line + "\n")
    print(line, flush=True)
