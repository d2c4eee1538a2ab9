"""Region B of benchmarks/cross_region.py: route TCP connects to region A through the WAN relays.

``ASTRAFLOW_BENCH_REDIRECT=127.0.0.1:9092=127.0.0.1:40001,...``: a connect to the left address goes
to the right one (a relay of benchmarks/_wan.py). Loaded by Python at start-up because this
directory is on the process's ``PYTHONPATH``; without the variable it changes nothing.
"""

import os
import socket

_ROUTES = {}
for _pair in filter(None, os.environ.get("ASTRAFLOW_BENCH_REDIRECT", "").split(",")):
    _src, _dst = _pair.split("=")
    _ROUTES[(_src.rsplit(":", 1)[0], int(_src.rsplit(":", 1)[1]))] = (_dst.rsplit(":", 1)[0], int(_dst.rsplit(":", 1)[1]))

if _ROUTES:
    _connect, _connect_ex = socket.socket.connect, socket.socket.connect_ex

    def _route(address):
        if isinstance(address, tuple) and len(address) >= 2:
            return _ROUTES.get((address[0], address[1]), address)
        return address

    socket.socket.connect = lambda self, address: _connect(self, _route(address))
    socket.socket.connect_ex = lambda self, address: _connect_ex(self, _route(address))
