"""How `./dev test` shares the suite between its two pytest-xdist workers: the longest work first.

``--dist loadscope`` hands a worker a whole module (or class) at a time, so that module-scoped fixtures (a server,
a model in an engine process) start once. xdist orders those units by their number of tests; a module of a few
long tests (the notebooks, several models behind one server) then came last, and one worker ran it while the
other had nothing left to do. Here the units known to be long go first, longest first (measured on 2 busy cores,
seconds), the rest after them as xdist orders them; and the modules in SPLIT, whose tests share no module-scoped
state, are split into one unit per test.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

LONGEST = {
    "tests/test_notebooks.py": 285,
    "tests/integration/test_chat_model.py": 230,  # estimated: the dict tool_choice on one prompt since
    "tests/integration/test_tool_calls_by_family.py": 180,  # estimated: its teardown ~15 s shorter since
    "tests/integration/test_engine_process.py": 129,
    "tests/integration/test_hostile_inputs_fail_typed.py": 83,
    "tests/integration/test_ray_serve.py": 80,  # estimated: on the tiny model since (98 -> 73 s alone)
    "tests/integration/test_chat_standard.py::TestChatExLlamaIntegrationServed": 72,
    "tests/integration/test_decisions_served.py": 69,
    "tests/integration/test_multi_model.py": 67,
    "tests/integration/test_langchain_llm.py": 65,  # estimated: its chain at 8 new tokens since
    "tests/integration/test_admission_and_engine_budgets.py": 63,
    "tests/integration/test_chat_standard.py::TestChatExLlamaIntegration": 59,
    "tests/integration/test_server.py": 58,
    "tests/integration/test_cross_framework.py": 56,
    "tests/integration/test_decisions.py": 55,  # estimated: two long checks on the tiny model since
    "tests/integration/test_reliability.py": 54,
    "tests/integration/test_llama_index.py": 50,  # estimated: complete/stream at 8 new tokens since
    "tests/integration/test_chat_standard.py::TestChatExLlamaIntegrationLlama3Tools": 46,
    "tests/integration/test_families_2026.py": 45,
    "tests/integration/test_embedding_clients.py": 41,
    "tests/integration/test_messages_api.py::TestChatAnthropicOnMessagesAPI": 40,  # estimated: on the tiny model since
}
"""Work units (a module, or a class) -> seconds their tests took (setup, call, teardown; a split module's
in all), from `--durations=0` of a full run on 2 cores beside load (load average 1.3 to 5.7), after the plumbing
tests moved to the tiny random model (tests/fixture_models.py make_tiny_smollm2). Units of 40 s or more; the longest
start first. Rough is enough: only their order matters."""

SPLIT = {
    "tests/test_notebooks.py": "each notebook runs in a kernel of its own; the tests share only session fixtures",
}
"""Modules whose tests are handed out one by one (why that is safe)."""


def _unit(nodeid: str) -> str:
    """The work unit of a test: its class or module (as xdist's loadscope groups), or itself in SPLIT's modules."""
    if nodeid.split("::")[0] in SPLIT:
        return nodeid
    return nodeid.rsplit("::", 1)[0]


def order(nodeids: list[str]) -> list[str]:
    """The collection, its units in the order they are handed out: known long units first (longest first; a split
    module's time shared among its tests), then the others by their number of tests (most first, as xdist does); a
    unit's tests keep their order."""
    units: dict[str, list[str]] = {}
    for nodeid in nodeids:
        units.setdefault(_unit(nodeid), []).append(nodeid)
    split = Counter(nodeid.split("::")[0] for nodeid in nodeids if nodeid.split("::")[0] in SPLIT)

    def weight(unit: str) -> float:
        module = unit.split("::")[0]
        return LONGEST.get(module, 0) / split[module] if module in split else LONGEST.get(unit, 0)

    ranked = sorted(units.items(), key=lambda kv: (-weight(kv[0]), -len(kv[1])))
    return [nodeid for _, ids in ranked for nodeid in ids]


def make_scheduler(config: Any, log: Any) -> Any:
    """xdist's loadscope scheduler over SPLIT's units, in the collection's order (each worker's collection is put in
    :func:`order`'s order by tests/conftest.py: xdist hands out tests by their index in it)."""
    from xdist.scheduler import LoadScopeScheduling

    class LongestFirst(LoadScopeScheduling):
        def __init__(self, config: Any, log: Any = None) -> None:
            super().__init__(config, log)
            self.config.option.loadscopereorder = False  # xdist's order (by number of tests) would replace ours

        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return LongestFirst(config, log)
