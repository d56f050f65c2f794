"""``decode="fast"``: exllamav3's own decode step, sampled in one batched pass and replayed from a captured graph.

exllamav3 (1.6.5) samples a decode step job by job and runs its forward eagerly (or as per-layer graphs). Here,
through the one seam onto exllamav3 (:mod:`.seam`, which wraps its generator as one unit): the step's logits are
taken as the model returns them and the first job that asks for its token has every covered job's token drawn at
once (:class:`~.sampler.BatchedSampler`); the decode forward is replayed from a captured CUDA graph where
:mod:`.graphs` can, and the next step's forward runs ahead of the step's bookkeeping where its rows are foreseen
(:mod:`.run_ahead`). Opt-in: the prompts of a step prefilled side by side (:mod:`.prefill`, ``prefill="batched"``).

What a request's tokens depend on (the guarantee, by default): the same as with exllamav3's own loop. Greedy tokens
are exllamav3's own, token for token, for the same requests scheduled the same way, and a run repeats itself
exactly; sampled draws depend on the request's seed and step only (counter-based noise, not on its neighbours).
exllamav3's own kernels choose their attention split and GEMM tiles by the number of rows in a step, so a request
alone and the same request inside a batch may part where two logits nearly tie. ``deterministic=True`` removes
that: each row of a decode step runs as a step of its own (its own table width, exllamav3's own launch for one
row), so a request's tokens are those exllamav3's own loop gives it alone, whatever decodes beside it; the cost is
one forward per row (benchmarks/results, run 15); its second strategy, the whole step with every launch choice pinned
(:mod:`.pinned`), awaits its GPU proof (:data:`.deterministic.STRATEGY`). Batched prefill is refused with it,
and prompts are prefilled in chunks of ``max_chunk_size`` starting on multiples of it (:mod:`.chunk_plan`), a cached
prefix reused in whole chunks only, with no K/V copied from a partly matching page and no page completed while
decoding offered to later prompts (:mod:`.deterministic`), so that what was cached before a request does not change
its K/V (docs/determinism.md).

Where it stands aside (:meth:`FastDecode.report` says which and how often):

* the whole generator: on an exllamav3 that :func:`.seam.stands_aside` refuses (``active`` is False, its reason
  in the report); exllamav3's own loop runs, and ``close()`` still releases everything;
* a step of several positions per job (a drafted window of speculative decoding, token healing): exllamav3
  samples it;
* a step with a single plain greedy job whose forward exllamav3 ran itself: nothing to batch, its argmax is the
  same token without our wrappers;
* a job, at that step, that exllamav3 samples as before: a grammar mask (a filter, or a mask exllamav3 adds
  itself), a forced token (``constrain_output_now``), logprobs asked for, its first token (exllamav3 checks that
  step's logits are finite), several sequences (CFG), penalties without their past ids; and, for its whole life,
  a job whose settings the batched sampler does not cover (:func:`~.sampler.uncovered`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..upstream.depends import installed_version
from . import deterministic as det
from .deterministic import rows_apart
from .graphs import DecodeGraphs
from .pinned import bucket
from .prefill import BatchedPrefill
from .sampler import BatchedSampler, RowSettings, row_settings, uncovered
from .seam import GeneratorView, JobView, Seam, stands_aside, view
from .seam.pins import LaunchPins, pins_stand_aside
from .step import Forward, PageCopy

logger = logging.getLogger(__name__)

LONE_GREEDY = "a lone greedy job on a step exllamav3 ran itself (its own argmax)"


class _Adopted:
    """What the fast path keeps for one job."""

    __slots__ = ("prompt_len", "settings")

    def __init__(self, settings: RowSettings, prompt_len: int) -> None:
        self.settings, self.prompt_len = settings, prompt_len


class FastDecode:
    """The fast decode path of one exllamav3 ``Generator`` (see the module docstring)."""

    def __init__(
        self,
        generator: Any,
        graphs: bool = True,
        ahead: bool = True,
        prefill: bool = False,
        deterministic: bool = False,
        max_rows: int = 64,
        recurrent: bool = False,
        strategy: str | None = None,
    ) -> None:
        """Hooks ``generator`` unless the seam stands aside (then ``active`` is False and nothing is hooked).

        ``graphs``: replay each decode forward from a captured CUDA graph where :mod:`.graphs` can (False: the
        batched sampler alone, for comparison); ``ahead``: run each captured step's forward ahead of its bookkeeping;
        ``prefill``: run the prompt chunks of a step in a few batched forwards; ``deterministic``: each row of a
        decode step as a step of its own, or (``strategy``, default :data:`.deterministic.STRATEGY`) the whole step
        with its launch choices pinned; ``max_rows``: the generator's largest batch; ``recurrent``: capture the
        steps of Gated DeltaNet and Mamba-2 hybrids and of sliding-window rings (gpt-oss, Gemma 4) too
        (``fast_recurrent``).
        """
        self.generator = generator
        self.deterministic = deterministic
        self.strategy = (strategy or det.STRATEGY) if deterministic else None
        self.pins: LaunchPins | None = None  # the pinned strategy's launch pins
        self.pins_stand_aside: str | None = None  # why the pinned strategy was asked for and the rows ran apart
        self.steps = 0
        self.tokens = 0
        self.row_forwards = 0  # deterministic: forwards of one row
        self.fallback: Counter[str] = Counter()
        self.not_adopted: Counter[str] = Counter()
        self.not_ahead: Counter[str] = Counter()  # steps not run ahead, and why
        self.sampler: BatchedSampler | None = None
        self.graphs: DecodeGraphs | None = None
        self.prefill: BatchedPrefill | None = None
        self.seam: Seam | None = None
        self._decode = False  # inside a decode step (not drafted), before its one target forward
        self._step: str | None = None
        self._logits: Any = None
        self._drawn: dict[int, Any] | None = None
        self._own_graphs = False  # this step's forward was left to exllamav3
        self._host: Any = None  # pinned: the step's drawn tokens, read back in one copy
        self.why_not = stands_aside()
        self.active = self.why_not is None
        if not self.active:
            logger.warning("decode='fast' stands aside: %s", self.why_not)
            return
        self.seam = Seam(generator)
        self.jobs = self.seam.jobs
        self.sampler = BatchedSampler(self.jobs.vocab_limit)
        if graphs:
            try:
                self.graphs = DecodeGraphs(
                    generator.model, max_rows=max_rows, ahead=ahead and not deterministic, recurrent=recurrent
                )
            except Exception:  # noqa: BLE001 - the batched sampler still runs; the forward stays eager
                logger.exception("decode='fast': the captured decode step could not be set up; it runs eagerly")
        if self.strategy == det.PINNED:
            self._pin(ahead, max_rows)
        if prefill:
            self.prefill = BatchedPrefill(self.jobs)
        try:
            table = self.graphs.pointer_table if self.graphs is not None and self.graphs.why_not is None else None
            on = self.prefill is not None and self.prefill.on
            self.seam.install(self, prefill=on, pointer_table=table, deterministic=deterministic)
        except Exception as e:  # noqa: BLE001 - nothing stays wrapped (install is all or nothing)
            logger.exception("decode='fast': hooking exllamav3 failed; its own loop runs")
            self.active, self.why_not = False, f"hooking exllamav3 failed: {type(e).__name__}: {e}"
            self._release()

    def _pin(self, ahead: bool, max_rows: int) -> None:
        """The pinned strategy where its pins hold (the whole step captured and run ahead), else the rows apart."""
        graphs = self.graphs
        why = "the decode step is not captured" if graphs is None else pins_stand_aside(graphs.view)
        if why is not None or graphs is None:
            self.strategy, self.pins_stand_aside = det.ROWS_APART, why
            logger.info("deterministic=True runs the rows of a step apart: the pins stand aside: %s", why)
            return
        self.pins = graphs.pinned = LaunchPins(graphs.view, bucket(max_rows))
        graphs.ahead = ahead

    # ------------------------------------------------------------------ the seam's hooks

    @contextmanager
    def step(self, drafted: bool) -> Iterator[None]:
        self._decode, self._logits, self._drawn = not drafted, None, None
        self._step, self._own_graphs = ("drafted" if drafted else "decode"), False
        try:
            yield
        finally:
            self._decode, self._logits, self._drawn, self._step = False, None, None, None

    def forward(self, call: Forward) -> Any:
        if self.prefill is not None:  # the forward reads the cache the held prompt chunks write
            self.prefill.flush("a model forward")
        if self._decode and call.step:
            apart = self.strategy == det.ROWS_APART
            out = self._rows_apart(call) if apart else self._one(call.eager, call.ids, call.params)
            self._own_graphs = self.graphs is not None and self.graphs.own_graphs_step
        else:
            out = call.run()
        if self._decode:  # the one target forward of a decode step
            self._decode, self._logits = False, out
        return out

    def _one(self, eager: Callable[..., Any], ids: Any, params: dict[str, Any]) -> Any:
        run = self._eager(eager)
        return self.graphs.forward(run, ids, params) if self.graphs is not None else run(ids, params)

    def _eager(self, eager: Callable[..., Any]) -> Callable[[Any, dict[str, Any]], Any]:
        """exllamav3's own forward of a decode step, under the launch pins where the pinned strategy runs."""
        pins = self.pins

        def run(i: Any, p: dict[str, Any]) -> Any:
            if pins is None:
                return eager(input_ids=i, params=p)
            with pins.applied():
                return eager(input_ids=i, params=p)

        return run

    def _rows_apart(self, call: Forward) -> Any:
        """``deterministic``: each row as a step of its own (:func:`.deterministic.rows_apart`)."""
        out, rows = rows_apart(lambda i, p: self._one(call.eager, i, p), call)
        self.row_forwards += rows
        return out

    def prefill_chunk(self, call: Forward) -> Any:
        assert self.prefill is not None
        return self.prefill.prefill(call)

    def copy_page(self, call: PageCopy) -> Any:
        assert self.prefill is not None
        return self.prefill.copy_page(call)

    def tokens_read(self, ids: list[int]) -> None:
        # exllamav3 calls this after the step's synchronize, with every row's token on the host (only after a step
        # our graph replayed: the rule's walk over the jobs is not paid where nothing can run ahead)
        if self._step == "decode" and self.graphs is not None and self.graphs.can_launch:
            pages = self._pages(ids)
            if pages is not None:
                try:
                    self.graphs.launch_ahead(ids, pages)
                except Exception:  # noqa: BLE001 - the steps go on as before, each forward in its own turn
                    logger.exception("decode='fast': running a step ahead failed; it is off for this model")
                    self.graphs.ahead = False
                    self.not_ahead["off: running ahead failed"] += 1

    def iterate_end(self) -> None:
        if self.prefill is not None:
            self.prefill.flush("the end of iterate()")

    # ------------------------------------------------------------------ load

    def capture_at_load(self, progress: bool) -> int:
        """Capture the decode step of every batch size now (``warmup=True``), not on a client's first step."""
        if not self.active or self.graphs is None or self.seam is None:
            return 0
        return self.graphs.capture_at_load(
            self._eager(self.seam.own_forward),
            self.jobs.cache,
            range(1, self.graphs.static.rows + 1),
            progress,
        )

    # ------------------------------------------------------------------ jobs

    def adopt_request(self, job: Any, request: Any) -> None:
        """Take ``job`` (built for ``request``, a BackendRequest) onto the fast path where its settings allow."""
        why = uncovered(request.settings)
        if why is not None:
            self.not_adopted[why] += 1
            return
        self.adopt(job, row_settings(request.settings), len(request.prompt_ids))

    def adopt(self, job: Any, settings: RowSettings, prompt_len: int) -> None:
        """Sample ``job``'s tokens in the batched pass from now on (where the rule allows, step by step)."""
        if not self.active or self.seam is None:
            return
        view(job).kept = _Adopted(settings, prompt_len)
        self.seam.adopt(job, self._token_for)

    # ------------------------------------------------------------------ a step

    def _pages(self, tokens: list[int]) -> list[int] | None:
        """Each row's allocated pages when the next step can be run ahead with ``tokens``, else None (and why).

        Not when the next step will have other rows: a job waiting to start or still in prefill, a job that ends
        or is requeued with the token it just drew; not when a job keeps its logits (exllamav3 copies them after
        this point, from the buffer the forward run ahead writes).
        """
        why = "jobs waiting to start" if self.jobs.waiting else None
        pages: list[int] = []
        for job in self.jobs.active if why is None else ():
            if not job.prefill_done:
                why = "a job in prefill"
            elif job.rows != 1:
                why = "several sequences"
            elif job.returns_logits:
                why = "logits returned"
            elif len(pages) < len(tokens) and job.ends_with(tokens[len(pages)]):
                why = "a job ends with this token"
            else:
                pages.append(job.pages)
                continue
            break
        if why is None and len(pages) != len(tokens):
            why = "tokens and rows differ"
        if why is not None:
            self.not_ahead[why] += 1
            return None
        return pages

    def _token_for(self, job: Any) -> Any:
        if self._step is None:
            self.fallback["outside a decode step"] += 1
            return None
        if self._logits is None or self._logits.shape[1] != 1:
            self.fallback["a step of several positions (drafting, healing)"] += 1
            return None
        if self._drawn is None:
            self._drawn = self._draw()
        self.tokens += id(job) in self._drawn
        return self._drawn.get(id(job))

    @staticmethod
    def _reason(job: JobView) -> str | None:
        """Why exllamav3 samples ``job`` at this step, or None when the batched pass does."""
        kept = job.kept
        if kept is None:
            return "not adopted"
        if job.forced:
            return "a forced token"
        if job.new_tokens < 1:
            return "its first token (exllamav3 checks the logits are finite)"
        if job.rows != 1:
            return "several sequences"
        if job.masked:
            return "a grammar or token mask"
        if job.wants_probs:
            return "logprobs"
        if kept.settings.penalised and job.past_ids is None:
            return "penalties without past ids"
        return None

    def _draw(self) -> dict[int, Any]:
        import torch

        assert self.sampler is not None
        rows, picked = 0, []  # (job, its row in the step's logits, what the fast path keeps for it)
        for job in self.jobs.active:
            if not job.prefill_done:
                continue
            why = self._reason(job)
            if why is None:
                picked.append((job, rows, job.kept))
            elif why != "not adopted":
                self.fallback[why] += 1
            rows += job.rows
        logits = self._logits
        if not picked or rows != logits.shape[0]:
            if picked:
                self.fallback["the step's rows differ from its jobs"] += len(picked)
            return {}
        if len(picked) == 1 and self._own_graphs and picked[0][2].settings.plain_greedy:
            # one greedy row on a step exllamav3 ran itself: nothing to batch, and its argmax is this one (the same
            # token, without the wrappers' host time)
            self.fallback[LONE_GREEDY] += 1
            return {}
        index = [r for _, r, _ in picked]
        first = index[0]
        if index == list(range(first, first + len(index))):
            block = logits[first : first + len(index), 0, :]
        else:
            at = torch.tensor(index, dtype=torch.long)
            block = logits[:, 0, :].index_select(0, at.to(logits.device, non_blocking=True))
        settings = [k.settings for _, _, k in picked]
        penalised = any(s.penalised for s in settings)
        try:
            tokens = self.sampler.sample(
                block,
                settings,
                [j.new_tokens for j, _, _ in picked],
                [j.past_ids if k.settings.penalised else None for j, _, k in picked] if penalised else None,
                [k.prompt_len for _, _, k in picked] if penalised else None,
            )
        except Exception:  # noqa: BLE001 - the step goes on through exllamav3's own samplers
            logger.exception("decode='fast': the batched pass failed; exllamav3 samples this step")
            self.fallback["the batched pass failed"] += len(picked)
            return {}
        self.steps += 1
        host = self._read_back(tokens)
        return {id(j.job): host[i : i + 1] for i, (j, _, _) in enumerate(picked)}

    def _read_back(self, tokens: Any) -> Any:
        """The step's tokens [n] copied into pinned host memory at once (without blocking), as [n, 1].

        exllamav3 synchronizes the device before it reads any token of the step, and copies what it keeps, so
        one buffer serves every step; a token it gets on the host is not copied again (it stages each CUDA token
        of the step through its own pinned buffer: one launch per job).
        """
        import torch

        if tokens.device.type != "cuda":
            return tokens.view(-1, 1)
        n = int(tokens.shape[0])
        if self._host is None or self._host.shape[0] < n:
            self._host = torch.empty((max(n, 64), 1), dtype=torch.long, pin_memory=True)
        host = self._host[:n]
        host.copy_(tokens.view(-1, 1), non_blocking=True)
        return host

    def close(self) -> None:
        """Run what is held, unhook everything and free the captured graphs (the counts stay for ``report()``).

        Safe whatever ``__init__`` reached, standing aside included: the model can always be released after it.
        """
        try:
            if self.prefill is not None:
                self.prefill.close()
        finally:
            self._release()

    def _release(self) -> None:
        if self.seam is not None:
            self.seam.remove()
        if self.graphs is not None:
            self.graphs.close()
        self.generator, self._logits, self._drawn, self._host = None, None, None, None

    # ------------------------------------------------------------------ diagnostics

    def report(self) -> dict[str, Any]:
        """Whether the fast path runs, how much it sampled, and what it left to exllamav3 (and why)."""
        if not self.active:
            return {"decode": "exllamav3", "stands_aside": self.why_not}
        return {
            "decode": "fast",
            "exllamav3": installed_version("exllamav3"),
            "deterministic": self.deterministic,
            **({"deterministic_strategy": self.strategy} if self.deterministic else {}),
            **({"pins_stand_aside": self.pins_stand_aside} if self.pins_stand_aside else {}),
            **({"pins": self.pins.report()} if self.pins is not None else {}),
            "batched_steps": self.steps,
            "batched_tokens": self.tokens,
            **({"row_forwards": self.row_forwards} if self.deterministic else {}),
            **({"private_pages": self.seam.private_pages} if self.deterministic and self.seam is not None else {}),
            **({"prefill_blocks": self.seam.blocks()} if self.deterministic and self.seam is not None else {}),
            "sampled_by_exllamav3": dict(self.fallback),
            "jobs_not_adopted": dict(self.not_adopted),
            "graphs": self.graphs.report() if self.graphs is not None else {"captured": False, "stands_aside": "off"},
            "not_run_ahead": dict(self.not_ahead),
            "prefill": self.prefill.report() if self.prefill is not None else {"batched": False, "stands_aside": "off"},
        }


__all__ = ["FastDecode", "GeneratorView", "LONE_GREEDY"]
