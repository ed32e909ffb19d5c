"""The machine's own limits that several benchmarks compare against, measured in their run."""

from __future__ import annotations

import os
import time
from typing import Any


def tcp_loopback(nbytes: int, block: int = 4 << 20, repeats: int = 1) -> dict[str, float]:
    """``sendall`` over 127.0.0.1 to a thread that ``recv_into``'s a buffer: the ceiling of any transfer
    between two processes of this machine (the best of ``repeats``): bytes, seconds, MiB/s and GiB/s."""
    import socket
    import threading

    best, got = float("inf"), [0]
    for _ in range(repeats):
        srv = socket.create_server(("127.0.0.1", 0))
        got = [0]

        def sink(srv: socket.socket = srv, got: list[int] = got) -> None:
            conn, _ = srv.accept()
            buf = bytearray(block)
            with conn:
                while n := conn.recv_into(buf):
                    got[0] += n

        t = threading.Thread(target=sink)
        t.start()
        data = os.urandom(block)
        with socket.create_connection(srv.getsockname()) as c:
            t0 = time.perf_counter()
            for _ in range(0, nbytes, block):
                c.sendall(data)
            c.shutdown(socket.SHUT_WR)
            t.join()
            best = min(best, time.perf_counter() - t0)
        srv.close()
    return {"bytes": got[0], "s": best, "mib_s": got[0] / (1 << 20) / best, "gib_s": got[0] / (1 << 30) / best}


def copy_crc_on(threads: int, src: Any, dst: Any, checksum: Any) -> float:
    """Seconds for ``threads`` threads to copy ``src`` into ``dst`` and CRC32C it, a part each (both
    calls let go of the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    bounds = [len(src) * i // threads for i in range(threads + 1)]

    def part(i: int) -> None:
        into = dst[bounds[i] : bounds[i + 1]]
        into.copy_(src[bounds[i] : bounds[i + 1]])
        checksum(into.numpy().data)

    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(part, range(threads)))
        return time.perf_counter() - t0
