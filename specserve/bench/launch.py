"""Start `specserve serve` as a subprocess for one measurement, and stop it afterwards."""
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]


class ServerStartError(RuntimeError):
    """The server exited before it was ready (e.g. its method needs a drafter the model lacks)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def specserve_command() -> list[str]:
    """The installed `specserve` script, else this interpreter running the server's own command line
    (which takes the same `serve ...` arguments)."""
    if script := shutil.which("specserve"):
        return [script]
    return [sys.executable, "-c", "import sys; from specserve.server.cli import main; sys.exit(main())"]


def serve_command(model_dir: str, method: str, port: int, extra_args: list[str]) -> list[str]:
    return [*specserve_command(), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
            "--speculative-method", method, *extra_args]


def wait_until_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise ServerStartError(f"the server exited with code {proc.returncode} before it was ready; "
                               f"its log ({log_path}) ends:\n{tail}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server at {base_url} was not healthy after {timeout_s:.0f}s (log: {log_path})")


@contextmanager
def launched_server(model_dir: str, method: str, log_path: Path, extra_args: list[str] = [],
                    timeout_s: float = 600.0) -> Iterator[str]:
    """Yields the base URL of a ready server; the server's output goes to `log_path`."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = serve_command(model_dir, method, port, list(extra_args))
    print(f"Starting: {shlex.join(cmd)}")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            base_url = f"http://127.0.0.1:{port}"
            wait_until_healthy(base_url, proc, timeout_s, log_path)
            yield base_url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
