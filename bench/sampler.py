"""
A separate process that samples established connections for the benchmark:
reading C{/proc/net/tcp} costs milliseconds of kernel time, which in the load
generator's own process would stall its reactor and show up as latency.

    python -m bench.sampler INTERVAL TARGETS_JSON

prints one JSON object per sample (name -> sorted local ports) until killed.
"""

from __future__ import annotations

import json
import sys
import time

from bench.procs import connected_ports


def main(argv: list[str]) -> int:
    interval = float(argv[0])
    targets = {name: (port, pid) for name, (port, pid) in json.loads(argv[1]).items()}
    while True:
        found = connected_ports(targets)
        sys.stdout.write(json.dumps({k: sorted(v) for k, v in found.items()}) + "\n")
        sys.stdout.flush()
        time.sleep(interval)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
