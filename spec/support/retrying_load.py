"""Retrying HTTP clients for spec/49 (python3, standard library only).

    retrying_load.py PORT CONNECTIONS SECONDS ACCOUNTS OUT

CONNECTIONS keep-alive clients POST /transfer of 1 between two random
accounts of ACCOUNTS (named a0, a1, ...), each request under a fresh
Idempotency-Key, for SECONDS.  A request whose connection is reset or
closed before its answer is sent again with the same key on a new
connection, as every HTTP client retries, up to 100 times.  OUT gets one
line per answer: "<time since start> <worker pid of X-Worker> <status>
<seconds from first send> <tries> <key>"; the line "start <epoch>" first.
"""
import asyncio
import random
import sys
import time


async def one_client(port, accounts, stop_at, t0, out, n):
    reader = writer = None
    k = 0
    while time.monotonic() < stop_at:
        k += 1
        key = "c%d-%d" % (n, k)
        a, b = random.sample(range(accounts), 2)
        body = '{"from":"a%d","to":"a%d","amount":1}' % (a, b)
        req = ("POST /transfer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               "Idempotency-Key: %s\r\nContent-Length: %d\r\n\r\n%s" % (key, len(body), body)).encode()
        first, tries = time.monotonic(), 0
        while tries < 100:
            tries += 1
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(req)
                await writer.drain()
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
                lines = head.decode().split("\r\n")
                status = int(lines[0].split()[1])
                length, worker, chunked = 0, "-", False
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    name = name.lower()
                    if name == "content-length":
                        length = int(value)
                    elif name == "transfer-encoding":
                        chunked = "chunked" in value.lower()
                    elif name == "x-worker":
                        worker = value.strip()
                if chunked:
                    while True:
                        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                        await reader.readexactly(size + 2)
                        if size == 0:
                            break
                else:
                    await reader.readexactly(length)
                now = time.monotonic()
                out.write("%.4f %s %d %.4f %d %s\n" % (now - t0, worker, status, now - first, tries, key))
                break
            except (ConnectionError, asyncio.IncompleteReadError, OSError):
                if writer is not None:
                    writer.close()
                reader = writer = None
                await asyncio.sleep(0.01)
    if writer is not None:
        writer.close()


async def main():
    port, conns, seconds, accounts, path = (int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]),
                                            int(sys.argv[4]), sys.argv[5])
    with open(path, "w", buffering=1) as out:
        t0 = time.monotonic()
        out.write("start %.4f\n" % time.time())
        out.flush()
        await asyncio.gather(*(one_client(port, accounts, t0 + seconds, t0, out, n) for n in range(conns)))


asyncio.run(main())
