"""Grammar compiles on worker threads, each waited for within a time budget, and the compiled ones kept.

llguidance compiles a grammar in Rust with the GIL dropped, in milliseconds for what people write, but a big
grammar takes seconds (an 840 KB Lark grammar of 60 000 alternatives: ~6 s on one core, ~25 s on a loaded host),
and the time grows faster than its size. So no loop that must answer compiles: the runtime's request preparation
and the engine process's receive loop (which answers liveness pings) hand the grammar to a
:class:`GrammarCompiler` and wait at most ``COMPILE_SECONDS`` for it (the engine waits on a thread of its own).
A compile over the budget ends its request with a typed :class:`~exllama_integrations.errors.ConstraintError`
(HTTP 400) at the budget; the compile itself runs on (a Rust compile cannot be stopped) and, if it succeeds, is
kept, so a retry of the same grammar is served at once. At most ``WORKERS`` compiles run at once; a compile
waiting for a worker spends its request's budget, so a flood of slow grammars delays grammar requests only, never
a generation or a ping.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

from ..errors import ConstraintError
from .grammar import TokenConstraint

if TYPE_CHECKING:
    from ..contract.api import Grammar
    from .tokenizer import NativeTokenizer

logger = logging.getLogger(__name__)

COMPILE_SECONDS = 10.0
"""Seconds a request waits for its grammar to compile (queued behind others included) before it is refused."""
WORKERS = 2
"""Grammar compiles that run at once, per runtime and per engine process."""
KEPT = 64
"""Compiled grammars kept for requests that use the same grammar again."""


class GrammarCompiler:
    """Compiles grammars for one tokenizer on worker threads; each caller waits within its budget.

    Example:
        >>> compiler = GrammarCompiler(rt.tokenizer)  # doctest: +SKIP
        >>> compiler.compile(Grammar.regex("[0-9]+")).matcher()  # doctest: +SKIP
    """

    def __init__(self, tokenizer: NativeTokenizer, budget: float | None = None) -> None:
        self.tokenizer = tokenizer
        self._budget = None if budget is None else float(budget)
        self._pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="exllama-grammar")
        self._lock = threading.Lock()
        self._kept: OrderedDict[Grammar, Future[TokenConstraint]] = OrderedDict()

    @property
    def budget(self) -> float:
        """Seconds a caller waits for a compile (the module's ``COMPILE_SECONDS`` unless one was given)."""
        return COMPILE_SECONDS if self._budget is None else self._budget

    def start(self, grammar: Grammar) -> Future[TokenConstraint]:
        """The compile of ``grammar``: one already done or under way, else a new one (returns at once)."""
        with self._lock:
            future = self._kept.get(grammar)
            if future is not None:
                self._kept.move_to_end(grammar)
                return future
            future = self._pool.submit(self._compile, grammar)
            self._kept[grammar] = future
            while len(self._kept) > KEPT:  # the oldest finished compile goes; one under way stays
                old = next((g for g, f in self._kept.items() if f.done()), None)
                if old is None:
                    break
                del self._kept[old]
            return future

    def _compile(self, grammar: Grammar) -> TokenConstraint:
        t0 = time.perf_counter()
        try:
            return TokenConstraint.compile(self.tokenizer, grammar)
        finally:
            took = time.perf_counter() - t0
            if took > self.budget:
                size = len(grammar.source)
                logger.warning("a %s grammar of %d characters took %.1f s to compile", grammar.kind, size, took)

    def compile(self, grammar: Grammar, deadline: float | None = None) -> TokenConstraint:
        """The compiled grammar, waited for until ``deadline`` (``time.monotonic()``; default: the budget from now).

        Raises:
            ConstraintError: the grammar does not compile, or did not within the budget.
        """
        future = self.start(grammar)
        if deadline is None:
            deadline = time.monotonic() + self.budget
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            raise over_budget(grammar, self.budget) from None

    def close(self) -> None:
        """Stop taking compiles (one under way finishes on its thread; nobody waits for it)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def over_budget(grammar: Grammar, budget: float) -> ConstraintError:
    """The typed refusal of a grammar that did not compile within ``budget`` seconds."""
    e = ConstraintError(
        f"the {grammar.kind} grammar ({len(grammar.source)} characters) did not compile within {budget:g} s, the "
        "limit of a grammar's compile (COMPILE_SECONDS); send a smaller grammar (fewer alternatives: a JSON schema's "
        "enum compiles far faster than the same words as Lark alternatives)."
    )
    e.param = "grammar"
    return e
