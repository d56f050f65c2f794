"""``decode="fast"``: exllamav3's own decode step, with the tokens of every covered job sampled in one batched pass.

exllamav3 (1.6.5) samples a decode step job by job: each job's ``receive_logits`` runs its sampler's kernels on
its row of the step's logits. Here the step's logits are taken as the model returns them, and the first job
that asks for its token has every covered job's token drawn at once (:class:`~.fast_sampler.BatchedSampler`);
each job then gets its own token back from ``receive_logits`` and exllamav3 goes on as before (one pinned
read-back and one synchronize for the step, stop conditions, streaming, page hashing, cancellation). Nothing
of exllamav3 is forked: the generator's ``iterate_gen`` and the model's ``forward`` are wrapped on their
instances, and each adopted job's ``receive_logits``. The decode forward itself is replayed from a captured CUDA
graph where :mod:`.decode_graphs` can (its own rule; the logits are the same either way, so every job gains,
whoever samples it), and the next step's forward is run ahead of the step's bookkeeping where the rows it will have
are foreseen (:meth:`FastDecode._pages` says when; ``model.prefetch_tokens``, which exllamav3 calls with every
row's token once they are read back, is where it starts). The prompts one step prefills run side by side in a
few forwards (:mod:`.batched_prefill`, ``prefill=False`` for exllamav3's job by job).

The rule (where it stands aside; :meth:`FastDecode.report` says which and how often):

* the whole generator, on any exllamav3 other than :data:`VERIFIED` (the version it was proven on, token for
  token against exllamav3's own loop on the H200): ``active`` is False and ``report()`` says why;
* a step of several positions per job (a drafted window of speculative decoding, token healing): exllamav3
  samples it;
* a step with a single covered job, greedy, whose forward exllamav3 replayed from its own per-layer graphs (EXL3
  weights, up to 8 rows): nothing to batch, and exllamav3's argmax is the same token without our wrappers;
* a job, at that step, that exllamav3 samples as before: a grammar mask (a filter, or a mask exllamav3 adds
  itself), a forced token (``constrain_output_now``), logprobs asked for, its first token (exllamav3 checks that
  step's logits are finite), several sequences (CFG), penalties without their past ids; and, for its whole life,
  a job whose settings the batched sampler does not cover (:func:`~.fast_sampler.uncovered`).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from .batched_prefill import BatchedPrefill
from .decode_graphs import DecodeGraphs
from .fast_sampler import BatchedSampler, RowSettings, row_settings, uncovered

logger = logging.getLogger(__name__)

LONE_GREEDY = "a lone greedy job on a step exllamav3 graphs itself (its own argmax)"

VERIFIED = "1.6.5"
"""The exllamav3 release this path was proven on (greedy tokens identical to its own loop for 128 steps at batch
1, 16 and 64 on an EXL3 and an fp16 model; sampled draws matched to its ComboSampler by a chi-square test)."""


def stands_aside() -> str | None:
    """Why the fast path cannot run with the installed exllamav3, or None when it can."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("exllamav3")
    except PackageNotFoundError:
        return "exllamav3 is not installed"
    if found != VERIFIED:
        return f"exllamav3 {found} is installed; decode='fast' was verified on {VERIFIED} only, so its own loop runs"
    return None


def _ends_with(job: Any, token: int) -> bool:
    """Whether exllamav3's ``receive_sample`` will end or requeue ``job`` on ``token``.

    A stop token, the token limit, the requeue budget; a stop string is not foreseen (the next step then misses).
    """
    n = job.new_tokens + 1
    rq = getattr(job, "max_rq_tokens", None)
    return token in job.stop_tokens or n >= job.max_new_tokens or (rq is not None and n > rq - job.rq_margin)


class _Adopted:
    """What the fast path keeps for one job."""

    __slots__ = ("prompt_len", "settings")

    def __init__(self, settings: RowSettings, prompt_len: int) -> None:
        self.settings, self.prompt_len = settings, prompt_len


class FastDecode:
    """The batched sampling of one exllamav3 ``Generator`` (see the module docstring)."""

    def __init__(self, generator: Any, graphs: bool = True, ahead: bool = True, prefill: bool = True) -> None:
        """Hooks ``generator`` unless the installed exllamav3 is not the verified one (then ``active`` is False).

        ``graphs``: also replay each decode forward from a captured CUDA graph where :mod:`.decode_graphs` can
        (False: the batched sampler alone, for comparison); ``ahead``: and run each captured step's forward ahead
        of its bookkeeping (:meth:`.DecodeGraphs.launch_ahead`; False: for comparison); ``prefill``: and run the
        prompt chunks of a step in a few batched forwards (:mod:`.batched_prefill`; False: job by job, as exllamav3).
        """
        self.generator = generator
        self.why_not = stands_aside()
        if self.why_not is None and not (hasattr(generator, "iterate_gen") and hasattr(generator.model, "forward")):
            self.why_not = "this exllamav3 Generator has no iterate_gen / Model.forward to hook"
        self.active = self.why_not is None
        self.steps = 0
        self.tokens = 0
        self.fallback: Counter[str] = Counter()
        self.not_adopted: Counter[str] = Counter()
        self.not_ahead: Counter[str] = Counter()  # steps not run ahead, and why
        self._capture = False
        self._step: str | None = None
        self._logits: Any = None
        self._drawn: dict[int, Any] | None = None
        self._own_graphs = False  # this step's forward was replayed from exllamav3's own per-layer graphs
        self._host: Any = None  # pinned: the step's drawn tokens, read back in one copy
        if not self.active:
            logger.warning("decode='fast' stands aside: %s", self.why_not)
            return
        self.sampler = BatchedSampler(getattr(generator.tokenizer, "actual_vocab_size", None))
        self.graphs: DecodeGraphs | None = None
        if graphs:
            try:
                self.graphs = DecodeGraphs(generator.model, ahead=ahead)
            except Exception:  # noqa: BLE001 - the batched sampler still runs; the forward stays eager
                logger.exception("decode='fast': the captured decode step could not be set up; it runs eagerly")
        self.prefill: BatchedPrefill | None = None
        if prefill:
            try:
                self.prefill = BatchedPrefill(generator)
            except Exception:  # noqa: BLE001 - prompts are prefilled job by job, as exllamav3 does
                logger.exception("decode='fast': batched prefill could not be set up; prompts are prefilled one by one")
        self._hook()

    def _hook(self) -> None:
        gen = self.generator
        iterate_gen, forward = gen.iterate_gen, gen.model.forward

        def fast_iterate_gen(results: list[Any], draft_tokens: Any = None) -> Any:
            self._capture, self._logits, self._drawn = draft_tokens is None, None, None
            self._step, self._own_graphs = ("decode" if draft_tokens is None else "drafted"), False
            try:
                return iterate_gen(results, draft_tokens)
            finally:
                self._capture, self._logits, self._drawn, self._step = False, None, None, None

        def fast_forward(*args: Any, **kwargs: Any) -> Any:
            if self.prefill is not None:  # the forward reads the cache the held prompt chunks write
                self.prefill.flush("a model forward")
            if self._capture and self.graphs is not None and not args and set(kwargs) == {"input_ids", "params"}:
                out = self.graphs.forward(forward, kwargs["input_ids"], kwargs["params"])
                self._own_graphs = self.graphs.own_graphs_step
            else:
                out = forward(*args, **kwargs)
            if self._capture:  # the one target forward of a decode step
                self._capture, self._logits = False, out
            return out

        prefetch = getattr(gen.model, "prefetch_tokens", None)

        def prefetch_tokens(ids: list[int]) -> None:
            # exllamav3 calls this after the step's synchronize, with every row's token on the host
            if prefetch is not None:
                prefetch(ids)
            # (only after a step our graph replayed: the rule's walk over the jobs is not paid where nothing can run
            # ahead, e.g. a lone EXL3 job on exllamav3's own graphs)
            if self._step == "decode" and self.graphs is not None and self.graphs.can_launch:
                pages = self._pages(ids)
                if pages is not None:
                    try:
                        self.graphs.launch_ahead(ids, pages)
                    except Exception:  # noqa: BLE001 - the steps go on as before, each forward in its own turn
                        logger.exception("decode='fast': running a step ahead failed; it is off for this model")
                        self.graphs.ahead = False
                        self.not_ahead["off: running ahead failed"] += 1

        gen.iterate_gen = fast_iterate_gen  # instance attributes shadow the methods
        gen.model.forward = fast_forward
        if prefetch is not None:
            gen.model.prefetch_tokens = prefetch_tokens

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
        if not self.active:
            return
        job.fast_decode_row = _Adopted(settings, prompt_len)  # kept on the job: it goes when the job goes
        own = job.receive_logits

        def receive_logits(logits: Any) -> Any:
            token = self._token_for(job)
            if token is None:
                return own(logits)
            self.tokens += 1
            return token, None, None, None

        job.receive_logits = receive_logits

    # ------------------------------------------------------------------ a step

    def _pages(self, tokens: list[int]) -> list[int] | None:
        """Each row's allocated pages when the next step can be run ahead with ``tokens``, else None (and why).

        Not when the next step will have other rows: a job waiting to start or still in prefill, a job that ends
        or is requeued with the token it just drew; not when a job keeps its logits (exllamav3 copies them after
        this point, from the buffer the forward run ahead writes).
        """
        gen, why = self.generator, None
        pages: list[int] = []
        if gen.pending_jobs:
            why = "jobs waiting to start"
        for job in gen.active_jobs:
            if why is not None:
                break
            if not job.is_prefill_done():
                why = "a job in prefill"
            elif len(job.sequences) != 1:
                why = "several sequences"
            elif job.return_logits:
                why = "logits returned"
            elif len(pages) < len(tokens) and _ends_with(job, tokens[len(pages)]):
                why = "a job ends with this token"
            else:
                pages.append(len(job.sequences[0].allocated_pages or ()))
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
        return self._drawn.get(id(job))

    def _reason(self, job: Any, kept: _Adopted | None) -> str | None:
        """Why exllamav3 samples ``job`` at this step, or None when the batched pass does."""
        if kept is None:
            return "not adopted"
        if job.forced_ids is not None and job.new_tokens >= 0:
            return "a forced token"
        if job.new_tokens < 1:
            return "its first token (exllamav3 checks the logits are finite)"
        if len(job.sequences) != 1:
            return "several sequences"
        if job.device_logit_mask is not None:
            return "a grammar or token mask"
        if job.return_probs or job.return_top_tokens:
            return "logprobs"
        if kept.settings.penalised and job.current_device_ids is None:
            return "penalties without past ids"
        return None

    def _draw(self) -> dict[int, Any]:
        import torch

        rows, picked = 0, []  # (job, its row in the step's logits, what the fast path keeps for it)
        for job in self.generator.active_jobs:
            if not job.is_prefill_done():
                continue
            kept = getattr(job, "fast_decode_row", None)
            why = self._reason(job, kept)
            if why is None and kept is not None:
                picked.append((job, rows, kept))
            elif why is not None and why != "not adopted":
                self.fallback[why] += 1
            rows += len(job.sequences)
        logits = self._logits
        if not picked or rows != logits.shape[0]:
            if picked:
                self.fallback["the step's rows differ from its jobs"] += len(picked)
            return {}
        if len(picked) == 1 and self._own_graphs and picked[0][2].settings.plain_greedy:
            # one greedy row on a step exllamav3 replayed from its own graphs: nothing to batch, and its argmax
            # is this one (the same token, without the wrappers' host time)
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
                [int(j.new_tokens) for j, _, _ in picked],
                [j.current_device_ids if k.settings.penalised else None for j, _, k in picked] if penalised else None,
                [k.prompt_len for _, _, k in picked] if penalised else None,
            )
        except Exception:  # noqa: BLE001 - the step goes on through exllamav3's own samplers
            logger.exception("decode='fast': the batched pass failed; exllamav3 samples this step")
            self.fallback["the batched pass failed"] += len(picked)
            return {}
        self.steps += 1
        host = self._read_back(tokens)
        return {id(j): host[i : i + 1] for i, (j, _, _) in enumerate(picked)}

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
        """Unhook the generator and the model and free the captured graphs (the counts stay for ``report()``)."""
        if self.prefill is not None:
            self.prefill.close()
        if self.graphs is not None:
            self.graphs.close()
        gen = self.generator
        if gen is not None and self.active:
            vars(gen).pop("iterate_gen", None)
            vars(gen.model).pop("forward", None)
            vars(gen.model).pop("prefetch_tokens", None)
        self.generator, self._logits, self._drawn, self._host = None, None, None, None

    # ------------------------------------------------------------------ diagnostics

    def report(self) -> dict[str, Any]:
        """Whether the fast path runs, how much it sampled, and what it left to exllamav3 (and why)."""
        if not self.active:
            return {"decode": "exllamav3", "stands_aside": self.why_not}
        return {
            "decode": "fast",
            "exllamav3": VERIFIED,
            "batched_steps": self.steps,
            "batched_tokens": self.tokens,
            "sampled_by_exllamav3": dict(self.fallback),
            "jobs_not_adopted": dict(self.not_adopted),
            "graphs": self.graphs.report() if self.graphs is not None else {"captured": False, "stands_aside": "off"},
            "not_run_ahead": dict(self.not_ahead),
            "prefill": self.prefill.report() if self.prefill is not None else {"batched": False, "stands_aside": "off"},
        }
