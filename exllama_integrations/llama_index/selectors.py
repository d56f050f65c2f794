"""``ExLlamaSelector``: LlamaIndex's ``BaseSelector``, choosing among options from the model's label probabilities.

The query is the state and the options a :class:`~..contract.decisions.Choice` (their names as labels where every
option has a distinct one, else their numbers from 1; their descriptions shown), answered as every decision is
(docs/decisions.md): the distribution over the labels read from one prefill's logits, nothing generated. The
selection is the likeliest option (``max_outputs`` of them, likeliest first), its reason the probability.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from llama_index.core.base.base_selector import BaseSelector, SelectorResult, SingleSelection
from llama_index.core.schema import QueryBundle
from llama_index.core.tools.types import ToolMetadata
from pydantic import SecretStr

from .._model_source import check_one_place, server_runtime
from ..contract.decisions import Choice, ChoiceAnswer, DecisionRequest, Label
from ..errors import InvalidSettingsError
from ..runtime.decisions import decider

INSTRUCTIONS = "Which option is the most relevant to the input?"


def option_labels(choices: Sequence[ToolMetadata]) -> tuple[Label, ...]:
    """The options as labels: their names where each has a distinct one, else their numbers from 1."""
    names = [c.name for c in choices]
    if all(names) and len({str(n).casefold() for n in names}) == len(names):
        return tuple(Label(str(c.name), c.description) for c in choices)
    return tuple(Label(str(i + 1), c.description) for i, c in enumerate(choices))


class ExLlamaSelector(BaseSelector):
    """A selector over a local model's decisions (one of ``model_dir=``, ``base_url=`` or ``runtime=``).

    Example:
        >>> selector = ExLlamaSelector(model_dir="path/to/model")  # doctest: +SKIP
        >>> selector.select(["Questions about billing", "Bug reports"], "I was charged twice").ind  # doctest: +SKIP
        0
    """

    def __init__(
        self,
        *,
        model_dir: str | None = None,
        base_url: str | None = None,
        runtime: Any = None,
        server_model: str | None = None,
        api_key: str | None = None,
        backend: str = "auto",
        instructions: str = INSTRUCTIONS,
        max_outputs: int = 1,
    ) -> None:
        """Load (or borrow) the runtime; ``instructions`` is the question asked about the query.

        Raises:
            InvalidSettingsError: not exactly one of model_dir, base_url and runtime; ``max_outputs`` below 1.
            UnsupportedTaskError: the runtime cannot answer decision questions.
        """
        place = SimpleNamespace(
            model_dir=model_dir,
            base_url=base_url,
            runtime=runtime,
            server_model=server_model,
            api_key=SecretStr(api_key) if api_key else None,
        )
        check_one_place(place)
        if max_outputs < 1:
            raise InvalidSettingsError(f"max_outputs must be at least 1, not {max_outputs}.", param="max_outputs")
        if runtime is None and base_url:
            runtime = server_runtime(place)
        elif runtime is None:
            from ..runtime.local import ExLlamaRuntime

            runtime = ExLlamaRuntime.shared(str(model_dir), backend)
        self.runtime = runtime
        self.instructions = instructions
        self.max_outputs = max_outputs
        decider(runtime)

    def _update_prompts(self, prompts: Any) -> None:
        """No prompt templates: the question's layout is the package's (docs/decisions.md)."""

    def _get_prompts(self) -> dict[str, Any]:
        return {}

    def _request(self, choices: Sequence[ToolMetadata], query: QueryBundle) -> DecisionRequest:
        question = Choice("selection", self.instructions, option_labels(choices))
        return DecisionRequest(query.query_str, (question,))

    def _result(self, answer: Any) -> SelectorResult:
        assert isinstance(answer, ChoiceAnswer)
        ranked = sorted(enumerate(answer.probabilities), key=lambda ip: (-ip[1][1], ip[0]))[: self.max_outputs]
        picks = [SingleSelection(index=i, reason=f"probability {p:.4f} (read from the model)") for i, (_, p) in ranked]
        return SelectorResult(selections=picks)

    def _select(self, choices: Sequence[ToolMetadata], query: QueryBundle) -> SelectorResult:
        return self._result(decider(self.runtime).decide(self._request(choices, query)).answers[0])

    async def _aselect(self, choices: Sequence[ToolMetadata], query: QueryBundle) -> SelectorResult:
        result = await decider(self.runtime).adecide(self._request(choices, query))
        return self._result(result.answers[0])


__all__ = ["ExLlamaSelector", "option_labels"]
