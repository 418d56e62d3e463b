"""gRPC servers of a job that take calls from this user only: the LOOPBACK worker pool.

With ``--environment_type=LOOPBACK`` (``--runner prism``, ``--runner portable`` with a job
server, ``--runner flink`` on an embedded Flink) Beam starts a worker pool in this process
(``BeamFnExternalWorkerPoolServicer``): whoever sends it a ``StartWorker`` request naming
their own control service has their pickled code run here, as this user. Beam has it listen
on every interface and take any caller. Here (:func:`private_loopback_workers`) it listens
on loopback only (``127.0.0.1``), and every call is first checked by :class:`SameUserOnly`:
a call whose TCP peer is a socket of another uid (looked up in ``/proc/net/tcp`` and
``tcp6`` by the peer's address and port: the client's socket is on this machine, as a
loopback peer is) is refused with ``PERMISSION_DENIED`` before it reaches the pool. The pool
stays on TCP because the job servers that dial it (Flink's is Java) need not speak unix
sockets. ``--runner portable`` with its embedded job service needs no pool at all
(:func:`refinery.runners.portable.runnable`). :mod:`.worker_pool` runs such a pool as its
own process (the local Flink cluster's, :mod:`.flink_local`).
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import grpc

from refinery.transforms.io import beam_private

LOOPBACK_HOST = "127.0.0.1"
TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def peer_address(peer: str) -> tuple[IPAddress, int] | None:
    """(IP, port) of a gRPC peer string (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``,
    ``ipv6:%5B::1%5D:5000``), an IPv4-mapped IPv6 address as its IPv4 one; None for any other
    kind of peer (``unix:...``)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    rest = rest.replace("%5B", "[").replace("%5D", "]")
    host, _, port = rest.rpartition(":")
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
        return _plain(ip), int(port)
    except ValueError:
        return None


def _plain(ip: IPAddress) -> IPAddress:
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped or ip


def _table_ip(hex_addr: str) -> IPAddress:
    """An address of ``/proc/net/tcp{,6}``: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_addr)
    return _plain(ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))))


def socket_owner(ip: IPAddress, port: int, tables: Iterable[str]) -> int | None:
    """The uid of the TCP socket whose local address is ``ip:port`` in the texts of
    ``/proc/net/tcp``-style ``tables`` (a listening socket's row excluded), or None."""
    ip = _plain(ip)
    for text in tables:
        for line in text.splitlines()[1:]:
            f = line.split()
            if len(f) < 8 or f[3] == "0A":  # 0A: TCP_LISTEN
                continue
            host, _, hex_port = f[1].partition(":")
            try:
                if int(hex_port, 16) == port and _table_ip(host) == ip:
                    return int(f[7])
            except ValueError:
                continue
    return None


def _read_tables() -> list[str]:
    out = []
    for path in TCP_TABLES:
        with contextlib.suppress(OSError):
            out.append(Path(path).read_text())
    return out


def refusal(peer: str, uid: int, tables: Callable[[], Iterable[str]] = _read_tables) -> str | None:
    """Why a call from ``peer`` is refused by a server of user ``uid``, or None when it is
    taken: a TCP peer whose socket belongs to another uid, or that cannot be found on this
    machine (a remote peer), is refused; a unix socket's peer is taken (its folder is what
    keeps other users out)."""
    where = peer_address(peer)
    if where is None:
        return None if peer.startswith("unix:") else f"refinery: a call from {peer}: not a peer it can check"
    owner = socket_owner(*where, tables())
    if owner is None:
        return f"refinery: a call from {peer}: no socket of this machine; only this machine's user {uid} is served"
    if owner != uid:
        return f"refinery: a call from {peer} (uid {owner}) refused: only uid {uid} is served"
    return None


class SameUserOnly(grpc.ServerInterceptor):  # type: ignore[misc]  # grpc's classes are untyped
    """A server interceptor: each call is first checked with :func:`refusal` (for this
    process's uid) and aborted with ``PERMISSION_DENIED`` when refused, before its handler
    runs (a call of a method the server does not have, too: another user learns nothing)."""

    def __init__(self, uid: int | None = None) -> None:
        self.uid = os.getuid() if uid is None else uid

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        uid = self.uid
        if handler is None:  # no such method: another user is refused all the same
            def unknown(requests: Any, context: Any) -> Any:
                context.abort(grpc.StatusCode.PERMISSION_DENIED if (why := refusal(context.peer(), uid)) else
                              grpc.StatusCode.UNIMPLEMENTED, why or "Method not found!")
            return grpc.stream_stream_rpc_method_handler(unknown)

        def checked(behavior: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
            def call(request: Any, context: Any) -> Any:
                why = refusal(context.peer(), uid)
                if why:
                    context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
                return behavior(request, context)
            return call

        kinds = {(False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
                 (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
                 (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
                 (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler)}
        name, make = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
        return make(checked(getattr(handler, name)), request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


@contextlib.contextmanager
def private_loopback_workers() -> Iterator[None]:
    """While inside: a LOOPBACK environment's worker pool (Beam's PortableRunner starts one
    per job) listens on :data:`LOOPBACK_HOST` only and serves this user only
    (:class:`SameUserOnly`)."""
    with beam_private.loopback_worker_pool_at(LOOPBACK_HOST, [SameUserOnly()]):
        yield
