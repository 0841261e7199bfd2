"""A simulated server in a process of its own: started with its base URL read back, stopped at
the end of a block.

In a thread of the caller's process a server shared the caller's GIL and garbage collector, and
a collection in a test run (a large heap) held calls up long enough to show as network
jitter; a process of its own answers as a remote provider would.
"""

from __future__ import annotations

import select
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from sluice.errors import MissingExtra
from sluice.settings import environment
from sluice.testing.simulated_server import ServerOptions

try:
    import uvicorn
    from starlette.types import ASGIApp
except ImportError as exc:
    raise MissingExtra("testing", "the simulated LLM provider", exc.name or "starlette") from None

#: The key a server expects, passed in its environment (a command line is visible to every user).
API_KEY_ENV = "SLUICE_TESTING_PROVIDER_KEY"
#: Seconds the provider's process may take to start (Python and its imports) and to stop.
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0


@contextmanager
def serve_app_in_process(module: str, args: Sequence[str], api_key: str | None = None) -> Iterator[str]:
    """Run ``python -m module *args`` (a server printing its base URL first); yield that URL.

    ``api_key`` reaches the child in its environment (:data:`API_KEY_ENV`), not on its command
    line, where ``ps`` shows it to every user. Leaving the block stops the child (SIGTERM,
    then SIGKILL after a few seconds).
    """
    env = {k: v for k, v in environment().items() if k != API_KEY_ENV}
    if api_key is not None:
        env[API_KEY_ENV] = api_key
    argv = [sys.executable, "-m", module, *args]
    proc = subprocess.Popen(
        argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        line = proc.stdout.readline().decode().strip() if ready else ""
        if not line.startswith("http://"):
            command = " ".join(["python", "-m", module, *(f"'{a}'" for a in args)])
            raise RuntimeError(
                f"the simulated provider did not start within {START_TIMEOUT_S:g} s "
                f"(exit code {proc.poll()}); run `{command}` to see why"
            )
        yield line
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def run_app(app: ASGIApp, host: str) -> None:
    """Bind a free port, print the base URL (the parent reads it), serve until SIGTERM."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    # Listening before the URL is printed: a client that connects at once finds the backlog,
    # not a refusal (uvicorn listens again on the given socket, which changes nothing).
    sock.listen(128)
    config = uvicorn.Config(
        app,
        lifespan="off",
        http="h11",
        ws="none",
        log_config=None,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    print(f"http://{host}:{sock.getsockname()[1]}", flush=True)
    server.run(sockets=[sock])


def options_from_argv(argv: Sequence[str]) -> ServerOptions:
    """The options a child was started with: the JSON argument, and the key from its environment."""
    text = argv[0] if argv else ServerOptions().public_json()
    return ServerOptions.from_public_json(text, environment().get(API_KEY_ENV))
