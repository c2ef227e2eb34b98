"""Starting an embedded local Ray instance (``ray.init(address="local")``) the one way the product does it."""
from __future__ import annotations

import sys

LOOPBACK = "127.0.0.1"
EMBEDDED_START_ATTEMPTS = 3


def start_embedded(**options) -> None:
    """``ray.init(address="local", **options)`` on 127.0.0.1 without a dashboard: a new embedded instance. Ray gives
    a raylet a fixed 30 s to register with its GCS; on a loaded machine it may miss that, so such a start is tried
    again (up to 3 attempts, each retry said on stderr) before its error ends the command."""
    import ray

    for attempt in range(1, EMBEDDED_START_ATTEMPTS + 1):
        try:
            ray.init(address="local", include_dashboard=False, _node_ip_address=LOOPBACK, configure_logging=False,
                     **options)
            return
        except Exception as error:  # noqa: BLE001 - Ray raises a bare Exception for this timeout
            if attempt == EMBEDDED_START_ATTEMPTS or "timed out during startup" not in str(error):
                raise
            ray.shutdown()
            print(f"ray: the local instance timed out during startup (attempt {attempt} of "
                  f"{EMBEDDED_START_ATTEMPTS}); starting it again", file=sys.stderr, flush=True)


__all__ = ["start_embedded"]
