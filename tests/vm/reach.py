"""TCP connection attempts from given source addresses, run inside the bed's network namespace.

`python -m tests.vm.reach` reads {"host": ..., "timeout_s": ..., "tries": [[source, port], ...]}
as JSON on stdin and prints, per try, "open" (connected), "refused" (a reset: the port is
reachable, nothing listens) or "timeout" (no answer: a firewall dropped the SYN). The tries run
at once, so a whole table costs one timeout.
"""

from __future__ import annotations

import errno
import json
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def attempt(host: str, source: str, port: int, timeout_s: float) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((source, 0))
        sock.settimeout(timeout_s)
        try:
            code = sock.connect_ex((host, port))
        except TimeoutError:
            return "timeout"
        if code == 0:
            return "open"
        if code == errno.ECONNREFUSED:
            return "refused"
        if code in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINPROGRESS):
            return "timeout"
        return errno.errorcode.get(code, str(code))


def main() -> None:
    call: dict[str, Any] = json.load(sys.stdin)
    tries = [(str(source), int(port)) for source, port in call["tries"]]
    with ThreadPoolExecutor(max_workers=len(tries)) as pool:
        results = list(
            pool.map(lambda t: attempt(call["host"], t[0], t[1], call["timeout_s"]), tries)
        )
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
