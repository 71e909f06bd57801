"""An mDNS announcement of a broker that is not there, or not the one it claims to be.

Run on a test host, it announces ``_zmqllm._tcp`` as `zmqllm broker --announce` would
(broker/announce.py), with the public key and models given (a fresh random key unless
``--key``), for the given backend address, until SIGTERM/SIGINT; then it withdraws it.
What `zmqllm worker --discover` must skip: an announcement is not trusted for its key.

    python -m testbed.fake_announce --backend tcp://198.18.0.3:5556 [--key Z85] [--models a,b]
"""

from __future__ import annotations

import argparse
import signal
import threading

import zmq

from zmqllm.broker.announce import Announcer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", required=True, help="tcp://ADDRESS:PORT to announce")
    p.add_argument("--key", default="", help="the public key to claim (z85; default: fresh)")
    p.add_argument("--models", default="", help="comma-separated models to claim")
    ns = p.parse_args()
    key = ns.key.encode() if ns.key else zmq.curve_keypair()[0]
    models = [m for m in ns.models.split(",") if m]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    announcer = Announcer(ns.backend, key, lambda: models)
    print(f"announced {announcer.info.name}", flush=True)
    try:
        stop.wait()
    finally:
        announcer.close()


if __name__ == "__main__":
    main()
