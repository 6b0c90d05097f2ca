"""`bertforge launch`: a multi-process run on this machine, each process with its own simulated CPU devices.

The processes meet through JAX's distributed runtime exactly as the hosts of a TPU pod or a GPU cluster do
(a coordinator address, a process count and an id each), so a command that works here works there unchanged.
Process 0 speaks on this terminal; the others write RUN/logs/process-N.log. When one process fails or dies, the
launcher says which and how, stops the rest, and exits non-zero: the same command then restarts all of them from
the last checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

from bertforge.errors import UserError

PREEMPTED = 143  # what a trainer returns after saving on SIGTERM: a clean stop, not a failure
GRACE_SECONDS = 5.0
NOISE = re.compile(r"^\[Gloo\] Rank \d+ is connected to")  # one line per peer from the CPU collectives


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    command: tuple[str, ...]  # a bertforge subcommand and its arguments
    num_processes: int = 2  # local processes, each one host of the run
    devices_per_process: int = 4  # simulated CPU devices of each process
    port: int = 0  # coordinator port; 0: a free one
    # Where each process's log goes (default: RUN/logs when the command has --out RUN, else a temporary folder).
    log_dir: str = ""

    def __post_init__(self) -> None:
        if self.num_processes < 1:
            raise ValueError(f"--num-processes must be at least 1, got {self.num_processes}")
        if self.devices_per_process < 1:
            raise ValueError(f"--devices-per-process must be at least 1, got {self.devices_per_process}")
        if not self.command:
            raise ValueError("no command: bertforge launch --num-processes N -- pretrain ...")
        if self.command[0] == "launch":
            raise ValueError("launch cannot launch itself")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _out_dir(command: tuple[str, ...]) -> str | None:
    for i, arg in enumerate(command):
        if arg == "--out" and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith("--out="):
            return arg.split("=", 1)[1]
    return None


def process_env(base: dict[str, str], process_id: int, cfg: LaunchConfig, port: int) -> dict[str, str]:
    """The environment of process `process_id`: the coordinator, the process count and its id, its CPU devices."""
    flags = [f for f in base.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={cfg.devices_per_process}")
    return {
        **base,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": " ".join(flags),
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "JAX_NUM_PROCESSES": str(cfg.num_processes),
        "JAX_PROCESS_ID": str(process_id),
        "PYTHONUNBUFFERED": "1",
    }


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _forward(stream, out) -> None:
    for line in iter(stream.readline, ""):
        if not NOISE.match(line):
            out.write(line)
            out.flush()


def _tail(path: Path, lines: int = 5) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip() and not NOISE.match(line)][-lines:]


def main(cfg: LaunchConfig) -> int:
    """Start the processes, wait for them; the exit status of the run (non-zero when any process failed)."""
    port = cfg.port or _free_port()
    log_dir = _log_dir(cfg)
    procs, logs, readers = _start(cfg, port, log_dir)
    print(
        f"launched {cfg.num_processes} processes x {cfg.devices_per_process} CPU devices "
        f"(coordinator 127.0.0.1:{port}, pids {', '.join(str(p.pid) for p in procs)}); "
        f"the other processes log to {log_dir}",
        file=sys.stderr,
        flush=True,
    )

    stopping: list[int] = []

    def forward_signal(signum: int, frame: object) -> None:
        stopping.append(signum)  # the trainers agree on a step, save a checkpoint together and exit 143
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, forward_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        failed = _wait(procs)
        if failed is not None:
            _stop(procs)
        for reader in readers:
            reader.join(timeout=GRACE_SECONDS)  # process 0's last lines before the verdict
        if failed is not None:
            return _report_failure(cfg, procs, log_dir, *failed)
        codes = [p.returncode for p in procs]
        return PREEMPTED if PREEMPTED in codes or stopping else 0
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for log in logs:
            log.close()


def _log_dir(cfg: LaunchConfig) -> Path:
    """--log-dir, else RUN/logs for a command with --out RUN (not a URL), else a temporary folder; made here."""
    out = _out_dir(cfg.command)
    log_dir = Path(cfg.log_dir or (Path(out) / "logs" if out and "://" not in out else tempfile.mkdtemp()))
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{log_dir}: cannot create the log folder ({e.strerror})") from None
    return log_dir


def _start(
    cfg: LaunchConfig, port: int, log_dir: Path
) -> tuple[list[subprocess.Popen], list[IO[str]], list[threading.Thread]]:
    """The processes; process 0's output forwarded to this terminal by reader threads, the others' to their logs."""
    argv = [sys.executable, "-m", "bertforge.cli", *cfg.command]
    procs: list[subprocess.Popen] = []
    logs: list[IO[str]] = []
    readers: list[threading.Thread] = []
    for i in range(cfg.num_processes):
        env = process_env(dict(os.environ), i, cfg, port)
        if i == 0:
            p = subprocess.Popen(
                argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace"
            )
            for stream, sink in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                readers.append(threading.Thread(target=_forward, args=(stream, sink), daemon=True))
                readers[-1].start()
        else:
            log = open(log_dir / f"process-{i}.log", "w")  # noqa: SIM115 (closed by main)
            logs.append(log)
            p = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append(p)
    return procs, logs, readers


def _report_failure(cfg: LaunchConfig, procs: list[subprocess.Popen], log_dir: Path, i: int, code: int) -> int:
    """Say which process failed and how, with the last lines of its log; the launcher's exit status."""
    lines = [] if i == 0 else _tail(log_dir / f"process-{i}.log")
    detail = "".join(f"\n  process {i}: {line}" for line in lines)
    print(
        f"error: process {i} of {cfg.num_processes} (pid {procs[i].pid}) {describe_exit(code)}; "
        f"stopped the others. Run the same command to restart all of them from the last checkpoint." + detail,
        file=sys.stderr,
        flush=True,
    )
    return 128 - code if code < 0 else code


def _wait(procs: list[subprocess.Popen]) -> tuple[int, int] | None:
    """Wait until all processes end well, or one fails: (its index, its return code)."""
    while True:
        running = False
        for i, p in enumerate(procs):
            code = p.poll()
            if code is None:
                running = True
            elif code not in (0, PREEMPTED):
                return i, code
        if not running:
            return None
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM the processes still running, then SIGKILL what is left after a grace period.

    They cannot save a checkpoint without the dead process (saving is collective), and a half-written one is never
    taken as complete; the grace period only lets them flush their logs."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
