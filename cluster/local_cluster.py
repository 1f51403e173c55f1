#!/usr/bin/env python
"""Start, inspect and stop several Ray nodes on this one host (two-node behaviour on one machine).

    python cluster/local_cluster.py start --nodes 2 [--cpus-per-node 2] [--gpus-per-node 1]
                                          [--env-node 1:PYTHONPATH=/tmp/shadow] [--no-auth]
                                          [--state FILE]
    python cluster/local_cluster.py status [--state FILE]
    eval "$(python cluster/local_cluster.py env [--state FILE])"   # then: ray-moe smoke
    python cluster/local_cluster.py stop   [--state FILE]

Node 0 is the head (``ray start --head --block``), nodes 1..N-1 join it
(``ray start --address HEAD --block``). Every node is its own process session, CPU-only
(``CUDA_VISIBLE_DEVICES=""``) or with its own slice of the host's GPUs
(node k gets GPUs k*G .. k*G+G-1). The state file (JSON) records the session id (= PID) of
every node, the address, the cluster's temp dir and the environment clients need. ``stop``
kills exactly the processes of those sessions; it never runs ``ray stop``, which would kill
every Ray process on the machine (other users' and other tests' clusters included).

Token authentication stays on (unless ``--no-auth``): ``start`` writes a fresh 256-bit token
to ``<cluster dir>/auth_token`` (mode 0600) and starts every node with ``RAY_AUTH_MODE=token``
and ``RAY_AUTH_TOKEN_PATH`` pointing at it; clients (drivers, ``ray-moe smoke``) connect with
the same two variables, which ``start`` and ``status`` print as ``export`` lines. The user's
``~/.ray/auth_token`` is neither read nor written.

Temp dirs are short (``/tmp/rmc-XXXXXX``): Ray's AF_UNIX socket paths must be < 108 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType

DEFAULT_STATE = Path(tempfile.gettempdir()) / "ray_moe_local_cluster.json"
SLOW_HOST_TIMEOUTS = MappingProxyType({"RAY_agent_register_timeout_ms": "120000", "RAY_raylet_start_wait_time_s": "120"})


@dataclass
class NodeRecord:
    """One `ray start --block` process (its PID is also its session and process-group id)."""

    index: int
    pid: int
    head: bool
    log: str
    cuda_visible_devices: str
    env: dict[str, str] = field(default_factory=dict)  # the --env-node extras of this node
    node_id: str = ""  # the Ray node id (hex), read from this node's raylet once it runs


@dataclass
class ClusterState:
    """What `start` records so that `status` and `stop` find exactly this cluster."""

    address: str
    temp_dir: str
    client_env: dict[str, str]
    nodes: list[NodeRecord]

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "ClusterState":
        raw = json.loads(path.read_text())
        return cls(raw["address"], raw["temp_dir"], raw["client_env"],
                   [NodeRecord(**n) for n in raw["nodes"]])


# ---------------------------------------------------------------------- helpers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def parse_env_node(items: list[str], nodes: int) -> dict[int, dict[str, str]]:
    """``K:NAME=VALUE`` strings → {K: {NAME: VALUE}}; errors name the bad item."""
    out: dict[int, dict[str, str]] = {}
    for item in items:
        head, sep, assignment = item.partition(":")
        name, eq, value = assignment.partition("=")
        if not sep or not eq or not head.isdigit() or not name:
            raise SystemExit(f"--env-node {item!r}: expected K:NAME=VALUE (K = node index, 0 = head)")
        k = int(head)
        if k >= nodes:
            raise SystemExit(f"--env-node {item!r}: node {k} does not exist (--nodes {nodes})")
        out.setdefault(k, {})[name] = value
    return out


def session_processes(sid: int) -> list[int]:
    """PIDs of every live process whose session id is ``sid`` (Linux /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # fields after the parenthesised command: state ppid pgrp session ...
        fields_after = stat[stat.rfind(")") + 2:].split()
        if len(fields_after) > 3 and int(fields_after[3]) == sid:
            pids.append(int(entry.name))
    return pids


def is_our_node(pid: int) -> bool:
    """The PID still runs `ray start` (guards against a recycled PID). Not for a process that
    was just spawned: its cmdline reads empty for a moment after exec."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(part.endswith(b"ray") for part in cmd) and b"start" in cmd


def kill_sessions(sids: list[int], grace_s: float = 3.0) -> None:
    """SIGTERM every process of the sessions at once, then SIGKILL what is left after ``grace_s``
    (one grace period for all nodes, not one per node)."""
    def alive() -> list[int]:
        return [pid for sid in sids for pid in session_processes(sid)]

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in alive():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not alive():
            return


def raylet_node_id(sid: int) -> str:
    """The Ray node id of the raylet in session ``sid`` (its ``--node_id=`` argument), or ''."""
    for pid in session_processes(sid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith("raylet"):
            for part in cmd:
                if part.startswith("--node_id="):
                    return part.split("=", 1)[1]
    return ""


def ray_bin() -> str:
    candidate = Path(sys.executable).parent / "ray"
    return str(candidate) if candidate.exists() else (shutil.which("ray") or "ray")


def alive_nodes(address: str, client_env: dict[str, str]) -> int:
    """Number of alive Ray nodes, asked through a short-lived driver in a subprocess."""
    code = "import ray; ray.init(address=%r, logging_level='ERROR', log_to_driver=False); " \
           "print(sum(n['Alive'] for n in ray.nodes()))" % address
    env = {**os.environ, **client_env}
    env.pop("RAY_ADDRESS", None)
    if "RAY_AUTH_MODE" not in client_env:
        env["RAY_AUTH_MODE"] = "disabled"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    return int(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else -1


# ---------------------------------------------------------------------- commands
def start(args: argparse.Namespace) -> int:
    state_path = Path(args.state)
    if state_path.exists():
        old = ClusterState.load(state_path)
        if any(is_our_node(n.pid) for n in old.nodes):
            print(f"a cluster from {state_path} is still running at {old.address}; stop it first",
                  file=sys.stderr)
            return 1
    env_node = parse_env_node(args.env_node, args.nodes)
    cluster_dir = tempfile.mkdtemp(prefix="rmc-", dir="/tmp")
    client_env: dict[str, str] = {}
    if args.no_auth:
        client_env["RAY_AUTH_MODE"] = "disabled"
    else:
        token_path = Path(cluster_dir) / "auth_token"
        token_path.touch(mode=0o600)
        token_path.write_text(secrets.token_hex(32))
        client_env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}
    base_env = {k: v for k, v in os.environ.items()
                if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    base_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{base_env.get('PATH', '')}"
    base_env |= client_env
    # a loaded host starts Python agents slowly: give them longer than Ray's defaults to register
    for name, value in SLOW_HOST_TIMEOUTS.items():
        base_env.setdefault(name, value)
    port = free_port()
    state = ClusterState("", cluster_dir, client_env, [])
    procs: list[subprocess.Popen] = []
    for k in range(args.nodes):  # the head first, then every other node at once
        gpus = list(range(k * args.gpus_per_node, (k + 1) * args.gpus_per_node))
        cvd = ",".join(map(str, gpus))
        cmd = [ray_bin(), "start", "--block", f"--num-cpus={args.cpus_per_node:g}",
               f"--num-gpus={args.gpus_per_node}", "--disable-usage-stats", *node_ports()]
        if args.node_ip:
            cmd.append(f"--node-ip-address={args.node_ip}")
        if k == 0:
            cmd += ["--head", f"--port={port}", f"--temp-dir={cluster_dir}",
                    f"--include-dashboard={'true' if args.dashboard else 'false'}",
                    f"--dashboard-port={free_port()}", f"--ray-client-server-port={free_port()}"]
        else:
            cmd += [f"--address={state.address}"]
        log_path = Path(cluster_dir) / f"node{k}.log"
        env = {**base_env, "CUDA_VISIBLE_DEVICES": cvd, **env_node.get(k, {})}
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        procs.append(proc)
        state.nodes.append(NodeRecord(k, proc.pid, k == 0, str(log_path), cvd, env_node.get(k, {})))
        state.save(state_path)  # recorded at once: a failed start can still be stopped
        if k == 0:
            if not wait_started(state.nodes, procs, args.timeout):
                return fail_start(state, state_path, "the head node did not come up")
            # the address Ray actually uses (the IP it picked, or --node-ip)
            state.address = head_address(Path(cluster_dir), Path(state.nodes[0].log), args.timeout)
            if not state.address:
                return fail_start(state, state_path, "the head node never told its address")
            state.save(state_path)
    if not wait_started(state.nodes, procs, args.timeout):
        return fail_start(state, state_path, f"not every node started within {args.timeout:g}s")
    alive = alive_nodes(state.address, client_env)
    if alive != args.nodes:
        return fail_start(state, state_path, f"{alive} of {args.nodes} nodes are alive in the cluster")
    for rec in state.nodes:
        rec.node_id = raylet_node_id(rec.pid)
    state.save(state_path)
    print_client_info(state, state_path)
    return 0


def node_ports() -> list[str]:
    """Free ports for the per-node services whose defaults are fixed (several clusters share a host)."""
    return [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}"]


def head_address(cluster_dir: Path, log: Path, timeout: float) -> str:
    """The head's address: Ray's ``ray_current_cluster`` file in the temp dir, which it may write
    a moment after printing that the runtime started (a CI run read it too early once), else the
    ``ray start --address=...`` line the head prints; "" if neither appears within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        path = cluster_dir / "ray_current_cluster"
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        found = re.search(r"ray start --address='([^']+)'", log.read_text(errors="replace") if log.exists() else "")
        if found:
            return found.group(1)
        if time.monotonic() > deadline:
            return ""
        time.sleep(0.2)


def wait_started(nodes: list[NodeRecord], procs: list[subprocess.Popen], timeout: float) -> bool:
    """Every node's `ray start` has printed that its runtime started (and is still running)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(proc.poll() is not None for proc in procs):
            return False
        logs = [Path(rec.log).read_text(errors="replace") if Path(rec.log).exists() else "" for rec in nodes]
        if all("Ray runtime started" in text for text in logs):
            return True
        time.sleep(0.5)
    return False


def fail_start(state: ClusterState, state_path: Path, why: str) -> int:
    print(f"local cluster start failed: {why}; logs:", file=sys.stderr)
    for rec in state.nodes:
        tail = Path(rec.log).read_text(errors="replace")[-1500:] if Path(rec.log).exists() else ""
        print(f"--- node {rec.index} ({rec.log})\n{tail}", file=sys.stderr)
    stop_cluster(state, state_path, keep_logs=True)
    return 1


def print_client_info(state: ClusterState, state_path: Path) -> None:
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in state.client_env.items())
    print(f"# {len(state.nodes)} Ray node(s) up; state in {state_path}")
    print(f"# clients need: export {exports}   (or: eval \"$(python {os.path.relpath(__file__)} env --state {state_path})\")")
    print(f"# stop with: python {os.path.relpath(__file__)} stop --state {state_path}")  # runnable from here
    print(state.address)


def stop_cluster(state: ClusterState, state_path: Path, keep_logs: bool = False) -> None:
    kill_sessions([rec.pid for rec in state.nodes if is_our_node(rec.pid) or session_processes(rec.pid)])
    if not keep_logs:
        shutil.rmtree(state.temp_dir, ignore_errors=True)
    state_path.unlink(missing_ok=True)


def load_recorded(args: argparse.Namespace) -> tuple[ClusterState, Path] | None:
    """The cluster recorded in ``--state``, or None (with a message) if there is none."""
    state_path = Path(args.state)
    if not state_path.exists():
        print(f"no local cluster recorded in {state_path}", file=sys.stderr)
        return None
    return ClusterState.load(state_path), state_path


def stop(args: argparse.Namespace) -> int:
    loaded = load_recorded(args)
    if loaded is None:
        return 1
    state, state_path = loaded
    stop_cluster(state, state_path, keep_logs=args.keep_logs)
    print(f"stopped {len(state.nodes)} node(s) of {state.address}")
    return 0


def status(args: argparse.Namespace) -> int:
    loaded = load_recorded(args)
    if loaded is None:
        return 1
    state, state_path = loaded
    running = [rec for rec in state.nodes if is_our_node(rec.pid)]
    for rec in state.nodes:
        what = "running" if rec in running else "gone"
        extra = f" env={rec.env}" if rec.env else ""
        print(f"node {rec.index}{' (head)' if rec.head else ''}: id {rec.node_id[:12] or '?'} pid {rec.pid} {what} "
              f"CUDA_VISIBLE_DEVICES={rec.cuda_visible_devices!r}{extra} log {rec.log}")
    alive = alive_nodes(state.address, state.client_env) if running else 0
    print(f"alive Ray nodes: {alive}")
    print_client_info(state, state_path)
    return 0 if len(running) == len(state.nodes) and alive == len(state.nodes) else 1


def env(args: argparse.Namespace) -> int:
    """Print `export` lines for clients: ``eval "$(python cluster/local_cluster.py env)"``."""
    loaded = load_recorded(args)
    if loaded is None:
        return 1
    state, state_path = loaded
    for name, value in {**state.client_env, "RAY_ADDRESS": state.address}.items():
        print(f"export {name}={shlex.quote(value)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("start", help="start N Ray nodes on this host")
    s.add_argument("--nodes", type=int, default=2)
    s.add_argument("--cpus-per-node", type=float, default=2)
    s.add_argument("--gpus-per-node", type=int, default=0, help="0 = CPU-only nodes")
    s.add_argument("--env-node", action="append", default=[], metavar="K:NAME=VALUE",
                   help="extra environment for node K only (0 = head), e.g. to plant a fault")
    s.add_argument("--node-ip", default=None, help="--node-ip-address for every node (default: Ray's choice)")
    s.add_argument("--dashboard", action="store_true", help="start the dashboard and job server on the head")
    s.add_argument("--no-auth", action="store_true", help="turn Ray token authentication off")
    s.add_argument("--timeout", type=float, default=120, help="seconds to wait for the nodes")
    s.set_defaults(fn=start)
    for name, fn, help_ in (("stop", stop, "kill exactly the nodes in the state file"),
                            ("status", status, "show the recorded nodes and how many are alive"),
                            ("env", env, "print export lines (auth, RAY_ADDRESS) for clients")):
        c = sub.add_parser(name, help=help_)
        c.set_defaults(fn=fn)
        if name == "stop":
            c.add_argument("--keep-logs", action="store_true", help="keep the cluster's temp dir")
    for c in sub.choices.values():
        c.add_argument("--state", default=str(DEFAULT_STATE), help=f"state file (default {DEFAULT_STATE})")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
