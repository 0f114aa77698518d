"""A rendezvous node in its own process, so tests can SIGKILL it for real.

Usage: python node.py ENDPOINT RUN_ID MIN MAX KEY=VALUE...
Prints one JSON line per event ({"node": ...}, {"rank": ..., "world_size": ...})
and then sleeps until killed.
"""

from __future__ import annotations

import json
import sys
import time

from elastic_ft.rendezvous import EtcdftRendezvousHandler, make_settings


def main() -> None:
    endpoint, run_id, min_nodes, max_nodes, *conf_items = sys.argv[1:]
    conf = dict(item.split("=", 1) for item in conf_items)
    handler = EtcdftRendezvousHandler(
        make_settings(run_id=run_id, endpoint=endpoint, min_nodes=int(min_nodes), max_nodes=int(max_nodes), **conf)
    )
    print(json.dumps({"node": handler.node}), flush=True)
    info = handler.next_rendezvous()
    print(json.dumps({"rank": info.rank, "world_size": info.world_size}), flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
