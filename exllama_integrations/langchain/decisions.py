"""``ExLlamaDecisions``: LangChain's ``BaseDecisionModel``, answered exactly from the model's label probabilities.

A ``Noul`` is P(yes) renormalised over the labels ``yes`` and ``no``; a ``Choice`` the distribution over its labels
(each scored by all its tokens); a ``Score`` the expected level under the distribution over its levels. Nothing is
generated or sampled: one prefill per state, the labels read from its logits (docs/decisions.md). The state
becomes text as OpenAI's Decisions client makes it: text as it is, human messages as their texts, anything else
as JSON text (messages in it in OpenAI's format).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from difflib import get_close_matches
from typing import Any

from langchain_core.decisions import BaseDecisionModel, ClassifierResponse
from langchain_core.decisions import Box as LcBox
from langchain_core.decisions import Choice as LcChoice
from langchain_core.decisions import Noul as LcNoul
from langchain_core.decisions import Score as LcScore
from langchain_core.messages import BaseMessage, HumanMessage, UsageMetadata, convert_to_openai_messages
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr

from .._model_source import check_one_place, server_runtime
from ..contract.decisions import (
    Box,
    Choice,
    ChoiceAnswer,
    DecisionRequest,
    DecisionResult,
    Label,
    Noul,
    NoulAnswer,
    Question,
    Score,
)
from ..errors import InvalidSettingsError, MediaError
from ..runtime.decisions import decider

MEDIA_BLOCKS = frozenset({"image", "image_url", "input_image", "file", "audio", "input_audio", "video"})


def content_text(value: Any) -> str:
    """Instructions or a description as text (JSON as JSON text, as OpenAI's client sends it)."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _json_value(value: Any) -> Any:
    if isinstance(value, BaseMessage):
        return convert_to_openai_messages(value)
    if isinstance(value, Mapping):
        if value.get("type") in MEDIA_BLOCKS:
            raise MediaError("the state holds media; decisions read text only here, send text.", param="state")
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):
        return [_json_value(v) for v in value]
    return value


def state_text(state: Any) -> str:
    """The text the model reads for a LangChain state (see the module docstring)."""
    if isinstance(state, str):
        return state
    messages = [state] if isinstance(state, BaseMessage) else state
    if isinstance(messages, Sequence) and messages and all(isinstance(m, HumanMessage) for m in messages):
        texts = []
        for m in messages:
            if not isinstance(m.content, str) and any(
                isinstance(b, dict) and b.get("type") in MEDIA_BLOCKS for b in m.content
            ):
                raise MediaError("a message of the state holds media; decisions read text only here.", param="state")
            texts.append(m.text)
        return "\n\n".join(texts)
    return json.dumps(_json_value(state), ensure_ascii=False)


def question_of(name: str, q: Any) -> Question:
    """A LangChain question as the contract's."""
    text = content_text(q.instructions)
    if isinstance(q, LcNoul):
        c = q.criteria
        yes = content_text(c.true) if c is not None and c.true is not None else None
        no = content_text(c.false) if c is not None and c.false is not None else None
        return Noul(name, text, yes, no)
    if isinstance(q, LcChoice):
        return Choice(
            name, text, tuple(Label(k, None if v is None else content_text(v)) for k, v in q.criteria.items())
        )
    if isinstance(q, LcScore):
        return Score(name, text, tuple(Label(content_text(level)) for level in q.criteria))
    if isinstance(q, LcBox):
        return Box(name, text)
    raise InvalidSettingsError(f"question {name!r} is a {type(q).__name__}; ask a Noul, Choice or Score.", "questions")


class ExLlamaClassifierResponse(ClassifierResponse):
    """LangChain's response, with what the model was shown: ``metadata["prompts"]`` by question name."""

    metadata: dict[str, Any] = Field(default_factory=dict)
    """``prompts`` (each question's prompt, through the chat template), ``prefix_tokens`` (read once for all) and
    ``backend``."""


class ExLlamaDecisions(BaseDecisionModel):
    """Decisions read from a local model's logits (one of ``model_dir=``, ``base_url=`` or ``runtime=``).

    Example:
        >>> from langchain_core.decisions import Choice, Noul
        >>> d = ExLlamaDecisions(model_dir="path/to/model")  # doctest: +SKIP
        >>> r = d.invoke({"state": "I was charged twice.", "questions": {"refund": Noul(instructions="Refund?")}})
        >>> r.nouls["refund"].noul  # doctest: +SKIP
        0.83
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, protected_namespaces=(), use_attribute_docstrings=True)

    model: str = ""
    """The model's name (its directory's, or the server's); ``model=`` at construction names the model to load."""
    model_dir: str | None = None
    """A model directory (or Hugging Face Hub id), loaded in this process (shared with the other classes)."""
    base_url: str | None = None
    """An exllama-integrations server (``http://127.0.0.1:8000``); questions go to its ``/v1/decisions``."""
    server_model: str | None = None
    """With ``base_url=``: which of the server's models; None: the server's first."""
    api_key: SecretStr | None = None
    """Bearer key for ``base_url``'s server (or set ``EXLLAMA_API_KEY``)."""
    runtime: Any = Field(default=None, exclude=True)
    """A loaded runtime (ExLlamaRuntime, RemoteRuntime, or one with the ``Decides`` capability) to use as it is."""
    backend: str = "auto"
    """``auto``, ``exllamav3`` or ``transformers`` (the backends that score labels)."""
    shared_runtime: bool = True
    """Reuse the runtime already loaded for this directory and options (True), or load a private one."""
    max_seq_len: int | None = None
    """Context length to allocate; None: the model's, capped by the backend's default."""
    dtype: str | None = None
    """Weights dtype (CPU reference: float32)."""
    device: str | None = None
    """Device (``cpu``, ``cuda:0``)."""
    backend_options: dict[str, Any] = Field(default_factory=dict)
    """Backend load options (unknown ones are refused by name)."""

    _runtime: Any = PrivateAttr(default=None)

    def __init__(self, **data: Any) -> None:
        """Load (or borrow) the runtime; ``model=`` names a directory, or with ``base_url=`` a served model.

        Raises:
            InvalidSettingsError: an unknown argument (the closest named), or not exactly one of model_dir, base_url
                and runtime.
            UnsupportedTaskError: the runtime cannot answer decision questions.
        """
        known = set(type(self).model_fields) | {"model"}
        unknown = sorted(k for k in data if k not in known)
        if unknown:
            hints = ", ".join(
                f"{k!r}" + "".join(f" (did you mean {c!r}?)" for c in get_close_matches(k, known, 1)) for k in unknown
            )
            raise InvalidSettingsError(f"unknown argument(s) for ExLlamaDecisions: {hints}.")
        if "model" in data and data.get("base_url"):
            data.setdefault("server_model", data.pop("model"))
        elif "model" in data and not data.get("runtime"):
            data.setdefault("model_dir", data.pop("model"))
        super().__init__(**data)
        check_one_place(self)
        if self.runtime is not None:
            self._runtime = self.runtime
        elif self.base_url:
            self._runtime = server_runtime(self)
        else:
            from ..runtime.local import ExLlamaRuntime

            factory = ExLlamaRuntime.shared if self.shared_runtime else ExLlamaRuntime
            assert self.model_dir is not None
            self._runtime = factory(
                self.model_dir,
                self.backend,
                max_seq_len=self.max_seq_len,
                dtype=self.dtype,
                device=self.device,
                **self.backend_options,
            )
        decider(self._runtime)  # a runtime that cannot answer is refused now, not at the first question
        self.model = self._runtime.model_info().name

    @property
    def _provider(self) -> str:
        return "exllama"

    @property
    def exllama_runtime(self) -> Any:
        """The runtime this class uses."""
        return self._runtime

    def _request(self, state: Any, questions: dict[str, Any]) -> DecisionRequest:
        return DecisionRequest(state_text(state), tuple(question_of(n, q) for n, q in questions.items()))

    def _response(self, request: DecisionRequest, result: DecisionResult) -> ExLlamaClassifierResponse:
        answers: dict[str, Any] = {}
        for q, a in zip(request.questions, result.answers):
            if isinstance(a, NoulAnswer):
                answers[q.name] = {"type": "noul", "noul": a.probability}
            elif isinstance(a, ChoiceAnswer):
                probs = {str(v): p for v, p in a.probabilities}
                answers[q.name] = {
                    "type": "choice",
                    "choice": str(a.choice),
                    "probabilities": probs,
                    "confidence": a.confidence,
                }
            else:
                answers[q.name] = {
                    "type": "score",
                    "score": a.score,
                    "legend": dict(enumerate(a.legend)),
                    "probabilities": dict(enumerate(a.probabilities)),
                    "confidence": a.confidence,
                }
        n = result.prompt_tokens
        usage = UsageMetadata(
            input_tokens=n,
            output_tokens=0,
            total_tokens=n,
            input_token_details={"cache_read": 0},
            output_token_details={"reasoning": 0},
        )
        prompts = {q.name: p for q, p in zip(request.questions, result.prompts)}
        meta = {
            "prompts": prompts,
            "prefix_tokens": result.prefix_tokens,
            "backend": self._runtime.model_info().backend,
        }
        return ExLlamaClassifierResponse(model=self.model, answers=answers, usage=usage, metadata=meta)

    def _classify(self, state: Any, questions: dict[str, Any]) -> ClassifierResponse:
        request = self._request(state, questions)
        return self._response(request, decider(self._runtime).decide(request))

    async def _aclassify(self, state: Any, questions: dict[str, Any]) -> ClassifierResponse:
        request = self._request(state, questions)
        return self._response(request, await decider(self._runtime).adecide(request))


__all__ = ["ExLlamaClassifierResponse", "ExLlamaDecisions", "state_text"]
