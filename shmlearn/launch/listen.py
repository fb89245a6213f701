"""Where a run listens (docs/security.md): on loopback for local runs and sweeps; under a launcher,
shmlearn's own listener (rank 0's store) only on the address MASTER_ADDR names.

torch.distributed's TCPStore binds every interface whatever host it is given (torch 2.4-2.13), so
the store's socket is bound here and handed over (TCPStore(master_listen_fd=...)). Gloo binds the
address the host name resolves to unless GLOO_SOCKET_IFNAME names an interface, and NCCL's
bootstrap picks a network interface unless NCCL_SOCKET_IFNAME does: a local run names the loopback
interface for both (LOOPBACK_ENV). None of these listeners authenticates a peer.
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import os
import socket
import sys
import threading
from typing import Dict, Iterator, Optional

from shmlearn.errors import BadInput

LOOPBACK = "127.0.0.1"


def loopback_interface() -> str:
    """The loopback interface's name: the one whose flags say IFF_LOOPBACK (Linux: 'lo')."""
    try:
        for _, name in socket.if_nameindex():
            with open(f"/sys/class/net/{name}/flags") as f:
                if int(f.read().strip(), 16) & 0x8:  # IFF_LOOPBACK
                    return name
    except (OSError, ValueError):
        pass
    return "lo"


def loopback_env() -> Dict[str, str]:
    """Variables that keep a local rank's Gloo and NCCL listeners on loopback."""
    lo = loopback_interface()
    return {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}


@contextlib.contextmanager
def on_loopback() -> Iterator[None]:
    """loopback_env() set while a local process group is made in this process (a 1-worker run in
    the caller's own process), the caller's values restored after."""
    new = loopback_env()
    saved = {k: os.environ.get(k) for k in new}
    os.environ.update(new)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(2048)
    except BaseException:
        s.close()
        raise
    return s


def bound_store(host: str, port: int, *, timeout: datetime.timedelta, world_size: Optional[int] = None,
                wait_for_workers: bool = False):
    """A master TCPStore listening on `host` (an IP address) only, `port` 0 for any free port.
    The store owns the socket from then on (torch closes it with the store)."""
    import torch.distributed as dist
    s = _listener(host, port)
    try:
        store = dist.TCPStore(host, s.getsockname()[1], world_size, True, timeout=timeout,
                              wait_for_workers=wait_for_workers, master_listen_fd=s.fileno())
    except BaseException:
        s.close()
        raise
    s.detach()  # torch closes the descriptor with the store: never close it twice
    return store


def master_ip(addr: str) -> Optional[str]:
    """MASTER_ADDR as the IP address of this host it names, or None when it names none of this
    host's addresses (then nothing narrower than every interface is known to reach it)."""
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((ip, 0))  # bindable: an address of this host
            return ip
        except OSError:
            continue
    return None


def resolve(addr: str, limit_s: float) -> None:
    """Refuse, in one line, a MASTER_ADDR that does not resolve, within limit_s (--timeout): the
    store's connect retries a name it cannot resolve until its own timeout, and a resolver that
    does not answer blocks getaddrinfo itself (a daemon thread asks, so the wait is bounded)."""
    found: dict = {}

    def look() -> None:
        try:
            found["infos"] = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
        except OSError as e:
            found["error"] = e
    t = threading.Thread(target=look, name="shmlearn-resolve", daemon=True)
    t.start()
    t.join(limit_s)
    if t.is_alive():
        raise BadInput(f"MASTER_ADDR={addr!r}: did not resolve within {limit_s:g} s (--timeout); "
                       f"expected a host name or IP address of rank 0's host")
    if "error" in found:
        e = found["error"]
        raise BadInput(f"MASTER_ADDR={addr!r}: cannot be resolved ({getattr(e, 'strerror', None) or e}); "
                       f"expected a host name or IP address of rank 0's host")


def launcher_store(addr: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta):
    """The store of a launcher's job (mpirun, srun, torchrun without its agent's store): rank 0
    hosts it on the address MASTER_ADDR names, the others connect to it. Rank 0 does not wait here
    for the others: launch.roll_call does, and names the ranks that never came. BadInput when
    MASTER_PORT is taken on rank 0's host."""
    import torch.distributed as dist
    if rank != 0:
        return dist.TCPStore(addr, port, world_size, False, timeout=timeout)
    taken = (f"MASTER_PORT={port}: already in use on {addr} (another job, or a process still holding it); "
             f"expected a free TCP port")
    ip = master_ip(addr)
    if ip is not None:
        try:
            return _cached(ip, port, lambda: bound_store(ip, port, timeout=timeout, world_size=world_size))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise BadInput(taken) from None
            raise
    print(f"shmlearn: MASTER_ADDR {addr} names no address of this host (rank 0); its store listens on "
          f"every interface", file=sys.stderr, flush=True)
    try:
        return _cached(addr, port, lambda: dist.TCPStore(addr, port, world_size, True, timeout=timeout,
                                                         wait_for_workers=False, multi_tenant=True))
    except dist.DistError as e:
        if "address already in use" in str(e).lower():
            raise BadInput(taken) from None
        raise


_stores: dict = {}


def _cached(host: str, port: int, make):
    """One store per address and port in this process: a script that calls shmlearn.train twice
    under a launcher rendezvouses twice on the same port (launch.init_process_group prefixes each
    group's keys), and a second server could not bind it while the first one lives."""
    key = (host, port)
    if key not in _stores:
        _stores[key] = make()
    return _stores[key]
