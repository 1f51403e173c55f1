"""Every Ray connection the command line makes (train, prepare, smoke, bench): bounded and checked
first, so that a wrong address or token is one line naming the address and the fix, within
seconds, instead of Ray's minutes of retries and warnings.

Before ``ray.init`` (:func:`connect`):

1. the token file: ``RAY_AUTH_TOKEN_PATH`` that names no readable, non-empty file (Ray's client
   aborts the process on it, printing a C++ stack trace);
2. ``auto``: the address of the cluster running on this machine (none: one line);
3. ``HOST:PORT``: the name resolves and the port accepts a TCP connection;
4. the port is a Ray GCS: an HTTP server there (the dashboard, 8265) is named at once, and one
   request (in a child process whose output is kept out of the terminal) must be answered
   within :data:`PROBE_S` seconds; a refused token is named with where it came from.

``ray://HOST:PORT`` (Ray Client) gets checks 1 and 3. No address: a new local cluster (check 1).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

PROBE_S = 15.0  # seconds a GCS has to answer one request (it answers in milliseconds when idle)
GCS_PORT_HINT = "the head's GCS port (6379 by default; `ray status` on the head prints the address)"

# The child process's request: one GcsClient call; its last line says how it went.
_PROBE = """
import sys
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1], cluster_id=None).cluster_id
    print("ok")
except BaseException as exc:
    print("error", type(exc).__name__, str(exc).replace(chr(10), " ")[:300])
"""


class ConnectError(RuntimeError):
    """This machine cannot attach to the Ray cluster asked for; the message names the address
    and what to fix."""


def connect(address: str | None = None, timeout_s: float = 60.0, log_to_driver: bool = True,
            **init_kwargs: Any) -> bool:
    """Attach to the Ray cluster at ``address`` (or ``RAY_ADDRESS``; ``auto``: the one running
    here), or start a local one when neither is given. Returns True when this call connected
    (False: Ray was initialised already, and ``address``, if it names a host and port, has the
    port of the cluster this process is attached to). Raises :class:`ConnectError` (one line) when
    the checks above fail, or ``ray.init`` does; ``timeout_s`` bounds name resolution and the TCP
    check."""
    import ray

    if ray.is_initialized():
        _check_attached_to(address)
        return False
    given = address
    address = address or os.environ.get("RAY_ADDRESS") or None
    where = _where(address, given)
    problem = token_problem()
    if problem:
        raise ConnectError(problem)
    if address == "auto":
        address = _running_here()
    if address and address != "local":
        check_reachable(address, timeout_s, where)
        if not address.startswith("ray://"):
            check_gcs(address, where)
    try:
        ray.init(address=address, log_to_driver=log_to_driver, **init_kwargs)
    except Exception as exc:  # noqa: BLE001 - version mismatch, a cluster that went away meanwhile
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise ConnectError(f"cannot connect to Ray at {where}: {type(exc).__name__}: {first}{auth_hint(exc)}") from None
    return True


def _check_attached_to(address: str | None) -> None:
    """Refuse an explicit ``host:port`` whose port differs from the GCS port of the cluster this
    process is attached to: the work would run on that cluster, not the one asked for. (The host
    is not compared: one cluster answers at its node's address, a hostname and 127.0.0.1.)"""
    if not address or address in ("auto", "local") or "://" in address or ":" not in address:
        return
    import ray

    attached = ray.get_runtime_context().gcs_address
    if address.rsplit(":", 1)[1] != attached.rsplit(":", 1)[1]:
        raise ConnectError(f"--address {address!r}: this process is attached to the Ray cluster at {attached!r} "
                           "already; call ray.shutdown() first, or leave the address out to use that cluster")


def _where(address: str | None, given: str | None) -> str:
    if not address:
        return "a new local cluster"
    return f"--address {address!r}" if given else f"RAY_ADDRESS={address!r}"


def token_problem() -> str | None:
    """Why ``RAY_AUTH_TOKEN_PATH`` cannot be used (it names no readable, non-empty file), or None."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if not path:
        return None
    file = Path(path).expanduser()
    try:
        empty = not file.read_text(errors="replace").strip()
    except OSError as exc:
        return (f"RAY_AUTH_TOKEN_PATH={path} cannot be read ({exc.strerror or exc}); point it at the "
                "cluster's token file (`ray get-auth-token` on the head prints the token) or unset it")
    if empty:
        return f"RAY_AUTH_TOKEN_PATH={path} is empty; put the cluster's token in it (`ray get-auth-token` on the head)"
    return None


def _running_here() -> str:
    """The address of the Ray cluster running on this machine (``--address auto``)."""
    from ray._private.services import canonicalize_bootstrap_address

    try:
        found = canonicalize_bootstrap_address("auto")
    except Exception:  # noqa: BLE001 - Ray's "Could not find any running Ray instance"
        found = None
    if not found:
        raise ConnectError("--address auto: no Ray cluster runs on this machine; start one (`ray start --head`) "
                           "or give --address HOST:PORT of its head")
    return found


def check_reachable(address: str, timeout_s: float, where: str | None = None) -> None:
    """Resolve the host and open a TCP connection to the port, both within ``timeout_s``."""
    import concurrent.futures

    where = where or f"--address {address!r}"
    target = address.split("://", 1)[-1].rstrip("/")
    host, sep, port_text = target.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ConnectError(f"{where} is not HOST:PORT (e.g. 10.0.0.1:6379, the head's GCS port), "
                           "ray://HOST:10001, auto or local")
    host, port = host.strip("[]"), int(port_text)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        pool.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM).result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise ConnectError(f"cannot resolve the host of {where} within {timeout_s:g}s "
                           "(parallel.startup_timeout_s); check the name and this machine's DNS") from None
    except socket.gaierror as exc:
        raise ConnectError(f"the host of {where} does not resolve ({exc.strerror}); "
                           "check the name, or use the head's IP address") from None
    finally:
        pool.shutdown(wait=False)
    try:
        with socket.create_connection((host, port), timeout=min(timeout_s, 10.0)):
            pass
    except ConnectionRefusedError:
        raise ConnectError(f"nothing listens at {where}: is the Ray head running there "
                           f"(`ray start --head`), and is this {GCS_PORT_HINT}?") from None
    except TimeoutError:
        raise ConnectError(f"no answer from {where} within {min(timeout_s, 10.0):g}s: a "
                           "firewall, a wrong host, or a head that is down") from None
    except OSError as exc:
        raise ConnectError(f"cannot reach {where}: {exc.strerror or exc}") from None


def check_gcs(address: str, where: str | None = None, probe_s: float = PROBE_S) -> None:
    """The port at ``address`` is a Ray GCS that accepts this driver's token: an HTTP server is
    named at once; otherwise one GcsClient request in a child process (Ray's C++ client retries
    and warns on stderr, which the child keeps) must be answered within ``probe_s``."""
    where = where or f"--address {address!r}"
    if _speaks_http(address):
        raise ConnectError(f"{where} is an HTTP server (Ray's dashboard or job server?), not a Ray GCS; "
                           f"give {GCS_PORT_HINT}")
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, address], capture_output=True, text=True,
                              timeout=probe_s, stdin=subprocess.DEVNULL)
        last = (done.stdout.strip().splitlines() or [""])[-1]
    except subprocess.TimeoutExpired:
        last = "timeout"
    if last == "ok":
        return
    if last.startswith("error AuthenticationError"):
        raise ConnectError(auth_refusal(address))
    if last == "timeout":
        raise ConnectError(f"{where} accepts connections but no Ray GCS answered there within {probe_s:g}s; "
                           f"give {GCS_PORT_HINT}")
    raise ConnectError(f"{where}: no Ray GCS answered ({last.removeprefix('error ') or 'the probe failed'}); "
                       f"give {GCS_PORT_HINT}")


def _speaks_http(address: str, timeout_s: float = 3.0) -> bool:
    """True when the server at ``address`` answers an HTTP/1 request (a GCS speaks gRPC only)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(b"GET / HTTP/1.0\r\nHost: ray\r\n\r\n")
            return sock.recv(8).startswith(b"HTTP/")
    except (OSError, ValueError):
        return False


def auth_refusal(address: str) -> str:
    """The line for a cluster that refused this driver's token: which token was sent (or that
    none was) and how to get the cluster's."""
    get = "get it on the head with `ray get-auth-token`"
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return (f"the Ray cluster at {address!r} requires token authentication and this driver sends no token: "
                f"export RAY_AUTH_MODE=token and give it the cluster's token in ~/.ray/auth_token, "
                f"RAY_AUTH_TOKEN_PATH=FILE or RAY_AUTH_TOKEN ({get})")
    if os.environ.get("RAY_AUTH_TOKEN"):
        source = "RAY_AUTH_TOKEN"
    elif os.environ.get("RAY_AUTH_TOKEN_PATH"):
        source = f"RAY_AUTH_TOKEN_PATH={os.environ['RAY_AUTH_TOKEN_PATH']}"
    else:
        source = "~/.ray/auth_token"
    return (f"the Ray cluster at {address!r} refused this driver's auth token (from {source}): it is not the "
            f"cluster's token (or is missing there); {get} and put it in {source}")


def auth_hint(exc: Exception) -> str:
    """What to check when a connection fails and token auth may be the cause."""
    text = f"{type(exc).__name__} {exc}".lower()
    if "auth" in text or "token" in text or os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return ("; if the cluster uses token auth, export RAY_AUTH_MODE=token and make its token "
                "available here (~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN)")
    return ""
