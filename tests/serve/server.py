"""A real `tensorsmith serve` process on a loopback port, for the tests to talk to with real clients."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Server:
    process: subprocess.Popen[str]
    url: str
    log: IO[str]

    def memory_kb(self, field: str = "VmRSS") -> int:
        """The server process's memory from /proc: VmRSS now, or VmHWM (its peak)."""
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith(f"{field}:")).split()[1])

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    @property
    def api(self) -> str:
        return f"{self.url}/v1"

    def stop(self) -> tuple[int, str]:
        """SIGTERM, as a container runtime stops it: the exit status and what it wrote."""
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)
        return self.process.returncode, self.output()


@contextlib.contextmanager
def serving(artifact: Path, *options: str, command: list[str] | None = None) -> Iterator[Server]:
    """`tensorsmith serve ARTIFACT OPTIONS` on a free port (or `command`, which names its own --port)."""
    if command is None:
        port = free_port()
        command = [sys.executable, "-m", "tensorsmith.cli.main", "serve", str(artifact), "--port", str(port), *options]
    else:
        port = int(command[command.index("--port") + 1])
    # its output to a file: a pipe nobody reads while it serves fills, and the server blocks writing its log
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
        server = Server(process, f"http://127.0.0.1:{port}", log)
        try:
            deadline = time.monotonic() + 120
            while True:
                assert process.poll() is None, f"the server exited: {server.output()}"
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                        break
                assert time.monotonic() < deadline, "the server did not become healthy in 120 s"
                time.sleep(0.2)
            yield server
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
