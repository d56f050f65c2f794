"""Real servers for the tests, on 127.0.0.1 only: uvicorn in a thread over a runtime, stopped at exit."""

from __future__ import annotations

import atexit
import socket
import threading
import time
from typing import Any


class ThreadServer:
    """The app over ``runtime`` served by uvicorn in a background thread, on a free port of 127.0.0.1."""

    def __init__(self, runtime: Any, **app_kwargs: Any) -> None:
        import uvicorn

        from exllama_integrations.serve.app import create_app

        self.app = create_app(runtime, **app_kwargs)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        t0 = time.perf_counter()
        while not self.server.started:
            if time.perf_counter() - t0 > 30 or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        atexit.register(self.stop)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


_shared: dict[str, ThreadServer] = {}


def demo_server() -> str:
    """The URL of one server over the shared demo runtime, started on first use (for suites built on properties)."""
    from exllama_integrations.demo_model import demo_model_dir

    return shared_server(demo_model_dir())


def shared_server(model_dir: Any) -> str:
    """The URL of one server over the shared runtime of ``model_dir``, started on first use."""
    key = str(model_dir)
    if key not in _shared:
        from exllama_integrations import ExLlamaRuntime

        _shared[key] = ThreadServer(ExLlamaRuntime.shared(model_dir, "transformers"))
    return _shared[key].url


def wait_until_up(url: str, seconds: float = 120, process: Any = None) -> None:
    """Return once ``url``'s /health answers 200 (a server in another process is loading its model); fail at once
    if ``process`` (its ``subprocess.Popen``) has exited."""
    import httpx

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        assert process is None or process.poll() is None, "the server process exited"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not come up")
