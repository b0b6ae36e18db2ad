"""``kvtierd``: the command-line entry of the daemon (``kvtierd --help`` lists every setting)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from kvtier.daemon.config import ConfigError, load_config
from kvtier.daemon.logs import setup_logging
from kvtier.daemon.server import StartupError, run


def main(argv: Sequence[str] | None = None) -> None:
    try:
        cfg = load_config(argv)
    except ConfigError as e:
        print(f"kvtierd: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    setup_logging(cfg.log_level, cfg.log_format)
    try:
        run(cfg)
    except StartupError as e:
        logging.getLogger("kvtier.server").error("cannot start: %s", e)
        print(f"kvtierd: cannot start: {e}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
