"""The calls the seam wraps, as typed values: a model forward and a page copy, each parsed once from exllamav3's call.

exllamav3 (1.6.5) runs a decode step as ``Model.forward(input_ids=..., params={...})`` (``Generator.iterate_gen``),
a prompt chunk as ``Model.prefill(input_ids=..., params={...})`` (``Job.prefill``), and reuses a partly matching page
with ``Cache.copy_page(cache, from_page, to_page, num_tokens)``. The seam hands the features a :class:`Forward` or a
:class:`PageCopy` instead of the raw ``(eager, args, kwargs)``: whether the call has the shape the features act on is
decided here once (``step`` / ``pages``), the step's rows, positions and block table are read through properties,
and the call is run as exllamav3 made it (``run()``) or with other inputs (``run_as``). How exllamav3 pads a step's
block table (:data:`TABLE_PAD`) is said here once too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TABLE_PAD = 16
"""exllamav3 pads a step's block table to a multiple of this many pages (``Generator.iterate_gen``)."""


def padded_width(pages: int) -> int:
    """The block-table width exllamav3 gives a step whose longest job holds ``pages`` pages."""
    return max(TABLE_PAD, -(-pages // TABLE_PAD) * TABLE_PAD)


@dataclass(frozen=True)
class Forward:
    """One model forward exllamav3 asked for (``Model.forward`` or ``Model.prefill``).

    ``ids`` and ``params`` are set where the call is exllamav3's keyword call (``input_ids=``, ``params=``): a step
    the features may act on (``step``); any other call is only run as it was made.
    """

    eager: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    step: bool = False
    ids: Any = None
    params: Any = None

    @classmethod
    def of(cls, eager: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Forward:
        if not args and set(kwargs) == {"input_ids", "params"}:  # exllamav3's own call: (input_ids=, params=)
            return cls(eager, args, kwargs, True, kwargs["input_ids"], kwargs["params"])
        return cls(eager, args, kwargs)

    @property
    def rows(self) -> int:
        return int(self.ids.shape[0])

    @property
    def block_table(self) -> Any:
        return self._param("block_table")

    @property
    def cache_seqlens(self) -> Any:
        """Each row's tokens already in the cache: the position its first input id takes."""
        return self._param("cache_seqlens")

    @property
    def recurrent_states(self) -> Any:
        return self._param("recurrent_states")

    @property
    def positions(self) -> Any:
        """Explicit positions (a drafted window, MRoPE), or None."""
        return self._param("positions")

    def _param(self, key: str) -> Any:
        return self.params.get(key) if isinstance(self.params, dict) else None

    def run(self) -> Any:
        """exllamav3's own forward, as it was called."""
        return self.eager(*self.args, **self.kwargs)

    def run_as(self, ids: Any, params: dict[str, Any]) -> Any:
        """exllamav3's own forward of other inputs (a row of the step, held chunks side by side)."""
        return self.eager(input_ids=ids, params=params)


@dataclass(frozen=True)
class PageCopy:
    """One ``Cache.copy_page`` exllamav3 asked for; ``pages`` is (from, to, tokens) when it copies within the cache."""

    eager: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    pages: tuple[int, int, int] | None = None

    @classmethod
    def of(cls, eager: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], cache: Any) -> PageCopy:
        plain = len(args) == 4 and not kwargs and args[0] is cache
        pages = (int(args[1]), int(args[2]), int(args[3])) if plain else None
        return cls(eager, args, kwargs, pages)

    def run(self) -> Any:
        """exllamav3's own copy, as it was called."""
        return self.eager(*self.args, **self.kwargs)


__all__ = ["TABLE_PAD", "Forward", "PageCopy", "padded_width"]
