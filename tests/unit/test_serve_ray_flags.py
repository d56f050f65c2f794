"""``serve --ray``: the limits a user gives as flags reach the Ray deployment, for one model and for several.

The command is run through the CLI as a user runs it, with Ray's start replaced by a recorder of the app's
configuration (what ``serve.run(build_app(...))`` would be given); the limits the ingress builds from that
configuration (:func:`~exllama_integrations.serve.ray.ingress.limits_from`) must be the limits the same flags give
a plain ``serve`` (:func:`~exllama_integrations.serve.launch.limits_of`). Ray itself is not started (the Ray
deployment's own wiring of ``limits`` is tested end to end in tests/integration/test_ray_serve.py).
"""

from __future__ import annotations

import argparse
import os

import pytest

from exllama_integrations import cli
from exllama_integrations.serve.launch import limits_of
from exllama_integrations.serve.ray import deployment
from exllama_integrations.serve.ray.ingress import limits_from

FLAGS = [
    "--max-tokens", "77",
    "--max-pending", "3",
    "--max-body-bytes", "123456",
    "--body-timeout", "4.5",
    "--allow-image-urls",
    "--image-url-allow", "10.0.0.0/8",
    "--image-url-allow", "images.internal",
]  # fmt: skip


@pytest.fixture
def recorded(monkeypatch):
    """What ``serve --ray`` hands to Ray: each run's app configuration, instead of starting Ray."""
    runs: list[dict] = []
    monkeypatch.setattr(deployment, "_run", lambda app_args, host, port, what: runs.append(app_args) or 0)
    return runs


def _parsed(argv: list[str]) -> argparse.Namespace:
    """The flags as the plain ``serve`` reads them (the CLI's own parser)."""
    seen: list[argparse.Namespace] = []
    import exllama_integrations.serve.launch as launch

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "serve_command", lambda args: seen.append(args) or 0)
        cli.main(argv)
    return seen[0]


@pytest.mark.parametrize(
    "models",
    [
        ["--model-dir", "/models/one"],
        ["/models/one", "/models/two"],
        ["--model", "/models/one", "--model", "/models/two"],
    ],
    ids=["one model", "several models", "several --model flags"],
)
@pytest.mark.parametrize("flags", [FLAGS, []], ids=["flags", "defaults"])
def test_the_serve_flags_reach_the_ray_deployments_limits(recorded, models, flags):
    argv = ["serve", "--ray", *models, *flags]
    assert cli.main(argv) == 0
    (app,) = recorded
    if models[0] == "--model-dir":
        assert app["model_dir"] == "/models/one"
    else:  # a deployment each behind one ingress, which builds the limits (`--model` given twice: both served, as vLLM
        # users write it, where argparse once read the second as the only `--model-dir`)
        assert [m["model_dir"] for m in app["models"]] == ["/models/one", "/models/two"]
    limits = limits_from(app)
    assert limits == limits_of(_parsed(argv))  # the same limits as a plain `serve` with these flags
    if flags:
        assert (limits.max_tokens, limits.max_pending, limits.max_body_bytes, limits.body_timeout) == (
            77,
            3,
            123456,
            4.5,
        )
        assert limits.media.fetch_urls and limits.media.fetch_allow == ("10.0.0.0/8", "images.internal")
    else:
        assert not limits.media.fetch_urls and limits.max_tokens is None


@pytest.mark.parametrize("models", [["--model-dir", "/models/one"], ["/models/one", "/models/two"]])
@pytest.mark.parametrize(
    "flag", [["--max-connections", "64"], ["--header-timeout", "3"], ["--timeout-keep-alive", "30"]]
)
def test_a_connection_flag_ray_would_not_read_is_refused(recorded, capsys, models, flag):
    """Ray Serve's proxy takes the connections with --ray: a limit meant for our server is refused, not dropped."""
    assert cli.main(["serve", "--ray", *models, *flag]) == 2
    assert recorded == []  # Ray was never started
    err = capsys.readouterr().err
    assert "InvalidSettingsError" in err and flag[0] in err and "Ray" in err


def test_the_environment_ray_starts_with(monkeypatch):
    """What ``serve --ray`` sets before Ray starts: the node on 127.0.0.1 when serving there, NVLink multicast off, and
    60 s for Ray Serve's proxy to start (its own 5 s kill a proxy on a busy machine), a user's own value kept."""
    from exllama_integrations.serve.ray.network import LOOPBACK, NO_MULTICAST, PROXY_READY_S, before_ray_starts

    for k in (*LOOPBACK, *NO_MULTICAST, *PROXY_READY_S):  # each restored after the test
        monkeypatch.delenv(k, raising=False)
    before_ray_starts("0.0.0.0")
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ  # a cluster on every address stays one
    assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "60"
    monkeypatch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "15")
    before_ray_starts("127.0.0.1")
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert os.environ["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "15"
