import os
import socket
import struct
import sys
import time
import urllib.request

url = sys.argv[1] + "/pods/" + os.environ["DENV_POD"]
agent = urllib.request.build_opener(urllib.request.ProxyHandler({}))
port, wait, settle = int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
hold, quiet_ms = sys.argv[5], float(sys.argv[6]) * 1000
start = time.monotonic()
try:
    request = urllib.request.Request(url + "/drain?hold_s=" + hold, method="POST")
    agent.open(request, timeout=5).read()
except OSError as e:
    print("no agent drained this pod:", e, file=sys.stderr)


def diag_rows(family):
    """(queued bytes, ms since a byte was sent, ms since one was received) of each established
    TCP connection from the port: the kernel's sock_diag answer, what `ss -ti` reads."""
    sock_id = struct.pack("=HH32sI", 0, 0, b"", 0) + struct.pack("=II", 0xFFFFFFFF, 0xFFFFFFFF)
    # inet_diag_req_v2: TCP, tcp_info wanted (INET_DIAG_INFO), state ESTABLISHED only.
    request = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 1 << 1, 1 << 1) + sock_id
    header = struct.pack("=IHHII", 16 + len(request), 20, 0x301, 1, 0)
    rows = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 4) as diag:
        diag.sendto(header + request, (0, 0))
        while True:
            data, offset = diag.recv(1 << 16), 0
            while offset + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, offset)
                if kind == 3:  # NLMSG_DONE
                    return rows
                if kind == 2:  # NLMSG_ERROR
                    raise OSError("sock_diag answered with an error")
                message = data[offset + 16 : offset + length]
                sport = struct.unpack_from("!H", message, 4)[0]
                rqueue, wqueue = struct.unpack_from("=II", message, 56)
                since_sent = since_received = 0
                at = 72
                while at + 4 <= len(message):
                    size, attr = struct.unpack_from("=HH", message, at)
                    if attr == 2 and size >= 4 + 56:  # INET_DIAG_INFO: struct tcp_info
                        since_sent, _, since_received = struct.unpack_from("=III", message, at + 48)
                    at += (size + 3) & ~3 if size else len(message)
                if sport == port:
                    rows.append((rqueue + wqueue, since_sent, since_received))
                offset += (length + 3) & ~3 if length else len(data)


def proc_rows():
    """Each established connection from the port in /proc/net/tcp, where sock_diag is refused:
    no timings there, so each one counts as carrying work."""
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                fields = [line.split() for line in lines.read().splitlines()[1:]]
        except OSError:
            continue
        for row in fields:
            if row[3] == "01" and int(row[1].rsplit(":", 1)[1], 16) == port:
                rows.append((1, 0, 0))
    return rows


def connections():
    """(busy, idle): busy carries work (bytes queued, or a byte either way within the quiet
    window); idle moved none for the quiet window, a balancer's connection kept for reuse."""
    try:
        rows = diag_rows(socket.AF_INET) + diag_rows(socket.AF_INET6)
    except OSError:
        rows = proc_rows()
    busy = sum(1 for q, s, r in rows if q > 0 or s < quiet_ms or r < quiet_ms)
    return busy, len(rows) - busy


while True:
    (left, idle), spent = connections(), time.monotonic() - start
    if left == 0 and spent >= settle:
        note = ""
        if idle:
            note = f"; {idle} idle connection(s), quiet for {quiet_ms / 1000:.0f} s or more"
        print(f"no streams open after {spent:.1f} s{note}")
        break
    if spent >= wait:
        print(f"{left} connections still open after {wait:.0f} s: cut", file=sys.stderr)
        break
    time.sleep(0.5)
