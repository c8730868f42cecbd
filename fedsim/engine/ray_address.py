"""Is a Ray cluster there?  Checked before a run or sweep that joins one records anything.

``ray.init(address=...)`` on a wrong address is slow and loud: ``auto`` with no Ray running raises a
``ConnectionError`` traceback, and a ``host:port`` nothing listens on retries for minutes while Ray's
C++ client prints a warning every few seconds.  :func:`check_ray_address` answers in at most
:data:`CONNECT_TIMEOUT_S` with a one-line :class:`~fedsim.errors.ConfigError`: ``auto`` is resolved
the way Ray resolves it (``RAY_ADDRESS``, the cluster ``ray start`` recorded, a running GCS), then the
head's port must accept a TCP connection (the GCS port for ``host:port``, the Ray Client server's for
``ray://host:port``).  What the check cannot see (a port that answers but is not Ray's, a proxy that
accepts every connection) still ends on one line: :func:`joining` turns ``ray.init``'s failure to
connect into a :class:`~fedsim.errors.RunFailedError`.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

from fedsim.errors import ConfigError, RunFailedError

#: How long the head's port may take to accept a connection.
CONNECT_TIMEOUT_S = 5.0
#: The ports Ray listens on when an address names none: the GCS, and the Ray Client server.
GCS_PORT, CLIENT_PORT = 6379, 10001


def cluster_address(configured: str | None) -> str | None:
    """The cluster a run or sweep joins: ``configured``, else ``$RAY_ADDRESS`` (as ``ray.init`` reads it),
    else None (a local Ray is started)."""
    return configured or os.environ.get("RAY_ADDRESS") or None


def _setting(configured: str | None, flag: str) -> tuple[str | None, str]:
    """:func:`cluster_address` and the setting it came from (``flag``, or ``RAY_ADDRESS``), for errors."""
    return cluster_address(configured), flag if configured else "RAY_ADDRESS"


def check_cluster(configured: str | None, flag: str) -> None:
    """Before joining a cluster: the address a run or sweep joins (``configured``, from ``flag``, else
    ``$RAY_ADDRESS``) answers; nothing to check when it joins none (a local Ray is started)."""
    address, setting = _setting(configured, flag)
    if address:
        check_ray_address(address, setting)


@contextlib.contextmanager
def joining(configured: str | None, flag: str) -> Iterator[None]:
    """Around ``ray.init``: its failure to join the cluster (``configured``, from ``flag``, else
    ``$RAY_ADDRESS``) as one line naming the setting; other errors, and a local Ray's, pass through."""
    try:
        yield
    except (ConnectionError, TimeoutError) as exc:
        address, setting = _setting(configured, flag)
        if not address:
            raise  # a local Ray that failed to start: not an address problem
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise RunFailedError(f"{setting}={address}: could not join the Ray cluster ({detail}); check that its head "
                             f"runs and that this machine reaches it") from None


def check_ray_address(address: str, flag: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """ConfigError (one line, naming ``flag``) unless a Ray cluster answers at ``address``; nothing to
    check when this process is already connected to Ray or ``address`` is ``local`` (Ray starts one)."""
    import ray

    if ray.is_initialized() or address == "local":
        return
    if address.startswith("ray://"):
        host, port = _host_port(address[len("ray://"):], CLIENT_PORT, address, flag)
    elif address == "auto":
        resolved = _resolve_auto(flag)
        if resolved is None:
            return  # Ray's lookup is not where it was: ray.init decides (and joining keeps it one line)
        host, port = _host_port(resolved, GCS_PORT, address, flag)
    else:
        host, port = _host_port(address, GCS_PORT, address, flag)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or type(exc).__name__).lower()
        found = " (found by Ray's lookup)" if address == "auto" else ""
        raise ConfigError(f"{flag}={address}: no Ray cluster answers at {host}:{port}{found} ({reason}); start its "
                          f"head there (`ray start --head`) or fix {flag}") from None


def _resolve_auto(flag: str) -> str | None:
    """``auto`` as ``ray.init`` resolves it: the cluster ``RAY_ADDRESS`` names, the one ``ray start``
    recorded, or a running GCS on this machine (None: this Ray keeps its lookup elsewhere)."""
    try:  # Ray's own lookup (private; the Ray version is the one flwr[simulation] pins)
        from ray._private.services import canonicalize_bootstrap_address, find_gcs_addresses
    except ImportError:
        return None

    find_gcs_addresses.cache_clear()  # Ray keeps what it found once for the life of the process: look again
    try:
        resolved = canonicalize_bootstrap_address("auto")
    except ConnectionError:
        resolved = None
    if not resolved:
        raise ConfigError(f"{flag}=auto but no Ray cluster runs on this machine; start one (`ray start --head`), "
                          f"name a remote one (host:port or ray://host:port), or drop {flag}")
    return resolved


def _host_port(target: str, default_port: int, address: str, flag: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep:
        host, port = target, str(default_port)
    host = host.strip("[]")  # [::1]:6379
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{flag}={address!r} is not a Ray address; use host:port, ray://host:port or auto")
    return host, int(port)
