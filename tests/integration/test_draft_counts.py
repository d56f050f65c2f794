"""A request's drafted tokens (speculative decoding, MTP heads): what its backend says on the last step reaches the
result's usage, OpenAI's ``completion_tokens_details.accepted_prediction_tokens`` / ``rejected_prediction_tokens``
(every choice summed) and ``/metrics`` (``exllama:spec_decode_*``: accepted / drafted is the acceptance).

The CPU backend drafts nothing, so here its last step is given counts on their way out of the real backend (the
runtime, the server and the client are real); the exllamav3 driver's counts from a drafting Generator are tested
with its fake in tests/unit/test_draft_rule.py and on the GPU in tests/gpu/test_gpu_mtp.py.
"""

from __future__ import annotations

import dataclasses

import httpx
import pytest
from servers import ThreadServer

from exllama_integrations.backends.base import BackendRequest

MODEL = "SmolLM2-135M-Instruct"


def test_a_requests_drafted_tokens_reach_its_usage_the_openai_shape_and_metrics(demo_runtime):
    from openai import OpenAI

    from exllama_integrations.backends.transformers import TransformersBackend

    assert demo_runtime.generate("The sky is", max_tokens=2).usage.accepted_draft_tokens == 0  # nothing drafted: 0
    submit = TransformersBackend.submit

    def with_counts(self, requests: list[BackendRequest]) -> None:
        """The real backend's steps, its last one saying 3 drafted tokens were accepted and 1 rejected."""

        def counted(req: BackendRequest) -> BackendRequest:
            emit = req.emit
            return dataclasses.replace(
                req, emit=lambda s: emit(dataclasses.replace(s, drafted=(3, 1)) if s.finish is not None else s)
            )

        submit(self, [counted(r) for r in requests])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TransformersBackend, "submit", with_counts)
        usage = demo_runtime.generate("The sky is", max_tokens=4, temperature=0).usage
        assert (usage.accepted_draft_tokens, usage.rejected_draft_tokens) == (3, 1)
        server = ThreadServer(demo_runtime)
        try:
            client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            msgs = [{"role": "user", "content": "Hi"}]
            one = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0).usage
            assert one.completion_tokens_details.accepted_prediction_tokens == 3
            assert one.completion_tokens_details.rejected_prediction_tokens == 1
            two = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=3, n=2, temperature=0.7).usage
            assert two.completion_tokens_details.accepted_prediction_tokens == 6  # every choice's counted
            text = httpx.get(server.url + "/metrics").text
            accepted = [ln for ln in text.splitlines() if ln.startswith("exllama:spec_decode_accepted_tokens_total")]
            drafted = [ln for ln in text.splitlines() if ln.startswith("exllama:spec_decode_draft_tokens_total")]
            assert float(accepted[0].rsplit(" ", 1)[1]) == 9.0 and float(drafted[0].rsplit(" ", 1)[1]) == 12.0
        finally:
            server.stop()
