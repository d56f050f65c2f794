"""The fast path's one seam onto exllamav3: the only module that reads or wraps exllamav3's internals.

What it relies on is declared in :mod:`.requirements` and checked against the installed library before anything is
wrapped; the features (the batched sampler, the captured step, running ahead, batched prefill) see exllamav3 only
through the typed views below and the hooks :class:`Seam` calls. :class:`Seam` installs every wrap of one generator
as one unit and removes them as one unit, whatever fails (as SGLang's ``patch_model`` does in one context).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from .requirements import PAGE_SIZE, PREFILL_PARAMS, STEP_PARAMS, VERIFIED, stands_aside

logger = logging.getLogger(__name__)

__all__ = ["PREFILL_PARAMS", "STEP_PARAMS", "VERIFIED", "stands_aside"]


def page_size() -> int:
    """Tokens per page of exllamav3's paged cache (:data:`.requirements.PAGE_SIZE`, checked against exllamav3's)."""
    return PAGE_SIZE


# ---------------------------------------------------------------------- views of jobs, pages and the generator


class JobView:
    """What the fast path reads of one exllamav3 ``Job`` (kept on the job: it goes when the job goes)."""

    __slots__ = ("job", "kept")

    def __init__(self, job: Any) -> None:
        self.job = job
        self.kept: Any = None  # what the fast path keeps for an adopted job

    @property
    def prefill_done(self) -> bool:
        return bool(self.job.is_prefill_done())

    @property
    def rows(self) -> int:
        """Sequences of the job (several with CFG): its rows in a step's logits."""
        return len(self.job.sequences)

    @property
    def new_tokens(self) -> int:
        return int(self.job.new_tokens)

    @property
    def forced(self) -> bool:
        """A forced token is pending (``constrain_output_now``) past token healing."""
        return self.job.forced_ids is not None and self.job.new_tokens >= 0

    @property
    def masked(self) -> bool:
        """A grammar or token mask applies at this step."""
        return self.job.device_logit_mask is not None

    @property
    def wants_probs(self) -> bool:
        return bool(self.job.return_probs or self.job.return_top_tokens)

    @property
    def returns_logits(self) -> bool:
        return bool(self.job.return_logits)

    @property
    def past_ids(self) -> Any:
        """The job's token ids so far on the device (prompt first), or None when exllamav3 did not prepare them."""
        return self.job.current_device_ids

    @property
    def pages(self) -> int:
        """Pages allocated to the job's first sequence."""
        return len(self.job.sequences[0].allocated_pages or ())

    def ends_with(self, token: int) -> bool:
        """Whether exllamav3's ``receive_sample`` will end or requeue the job on ``token``.

        A stop token, the token limit, the requeue budget; a stop string is not foreseen.
        """
        job = self.job
        n = job.new_tokens + 1
        rq = getattr(job, "max_rq_tokens", None)
        return token in job.stop_tokens or n >= job.max_new_tokens or (rq is not None and n > rq - job.rq_margin)


def view(job: Any) -> JobView:
    """The job's :class:`JobView` (made once, kept on the job)."""
    v = getattr(job, "fast_decode_view", None)
    if v is None:
        v = job.fast_decode_view = JobView(job)
    return v


class PageView:
    """What batched prefill reads of one cache page (a view: the page's current values)."""

    __slots__ = ("page",)

    def __init__(self, page: Any) -> None:
        self.page = page

    @property
    def ref_count(self) -> int:
        return int(self.page.ref_count)

    @property
    def kv_position(self) -> int:
        return int(self.page.kv_position)

    def tokens(self, n: int) -> Any:
        """The page's first ``n`` token ids (a copy)."""
        return self.page.sequence[0, :n].clone()


class GeneratorView:
    """What the features read of one exllamav3 ``Generator``."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator

    @property
    def active(self) -> list[JobView]:
        return [view(j) for j in self.generator.active_jobs]

    @property
    def waiting(self) -> bool:
        """Jobs are waiting to start."""
        return bool(self.generator.pending_jobs)

    @property
    def max_chunk_size(self) -> int:
        return int(self.generator.max_chunk_size)

    @property
    def vocab_limit(self) -> int | None:
        return getattr(self.generator.tokenizer, "actual_vocab_size", None)

    @property
    def cache(self) -> Any:
        return self.generator.cache

    def pages_by_index(self) -> dict[int, PageView]:
        return {int(p.page_index): PageView(p) for p in self.generator.pagetable.all_pages}

    def prefill_stands_aside(self) -> str | None:
        """Why no prompt chunk of this generator can be held for batched prefill, or None when chunks can be."""
        gen = self.generator
        if getattr(gen, "draft_model", None) is not None:
            return "a draft model (its prefill follows the target's)"
        if getattr(gen, "recurrent_cache", None) is not None:
            return "a recurrent cache (checkpoints follow each chunk)"
        if getattr(gen.model, "loaded_tp", False):
            return "tensor parallelism"
        if getattr(gen, "cpu_page_cache", None) is not None or getattr(gen, "disk_page_cache", None):
            return "host page tiers"
        return None


# ---------------------------------------------------------------------- the model, for the captured step


class ModelView:
    """The model's decode forward split at the embedding, for capture (``Model.forward_ls`` from the first block)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.embedding: Any = None
        self.layers: list[Any] = []
        self.device: Any = None
        self.why_not = self._stands_aside()
        if self.why_not is None:
            mods = model.fwd_modules
            self.embedding, self.layers, self.device = mods[0][0], mods[1:], mods[1][0].device

    def release(self) -> None:
        """Drop every reference to the model (it is about to unload)."""
        self.model = self.embedding = self.device = None
        self.layers = []
        self.why_not = self.why_not or "closed"

    def _stands_aside(self) -> str | None:
        try:
            from exllamav3.modules.attn import Attention
            from exllamav3.modules.embedding import Embedding
            from exllamav3.modules.layernorm import LayerNorm
            from exllamav3.modules.linear import Linear
            from exllamav3.modules.mlp import MLP, GatedMLP
            from exllamav3.modules.rmsnorm import RMSNorm
            from exllamav3.modules.transformer import TransformerBlock
        except ImportError as e:
            return f"exllamav3's modules do not import ({e})"
        model = self.model
        if getattr(model, "loaded_tp", False):
            return "a tensor-parallel model"
        if "mrope" in (getattr(model, "caps", {}) or {}):
            return "MRoPE positions"
        if list(model._get_prefetch_layers):
            return "a layer that prefetches per-token rows"
        if getattr(model.config, "moe_cpu_hosts", None):
            return "MoE experts on the CPU"
        mods = list(model.fwd_modules)
        if not mods or type(mods[0][0]) is not Embedding:
            return "the first module is not a token embedding"
        devices = set()
        for module, _, _ in mods[1:]:
            kind = type(module)
            if kind is TransformerBlock:
                if getattr(module, "attn_hc", None) or getattr(module, "mlp_hc", None):
                    return "hyper-connections"
                attn, mlp = module.attn, module.mlp
                if attn is not None and (type(attn) is not Attention or getattr(attn, "qsa_indexer", None) is not None):
                    return f"an attention layer of kind {type(attn).__name__}"
                if mlp is not None and type(mlp) not in (MLP, GatedMLP):
                    return f"an MLP of kind {type(mlp).__name__}"
            elif kind not in (RMSNorm, LayerNorm, Linear):
                return f"a layer of kind {kind.__name__}"
            devices.add(str(module.device))
        if len(devices) != 1 or not next(iter(devices)).startswith("cuda"):
            return f"layers on {sorted(devices)} (one CUDA device only)"
        return None

    def has_own_graphs(self) -> bool:
        """Whether exllamav3 graphs this model's layers itself at small batches (EXL3 weights)."""
        from exllamav3.modules.linear import Linear

        return any(
            isinstance(m, Linear) and getattr(m, "quant_type", None) == "exl3" for m in _walk(self.model.modules)
        )

    def prepare_inputs(self, input_ids: Any, params: dict[str, Any]) -> Any:
        return self.model.prepare_inputs(input_ids, params)

    def tables(self, params: dict[str, Any]) -> tuple[Any, Any]:
        """The step's block table and cache lengths on the model's device (exllamav3's per-dict upload cache)."""
        from exllamav3.util.tensor import get_for_device

        return get_for_device(params, "block_table", self.device), get_for_device(params, "cache_seqlens", self.device)

    def embed(self, x: Any, params: dict[str, Any]) -> Any:
        params["layer_instance"] = self.model.fwd_modules[0][1]
        params["resid_defer"] = False
        x = self.embedding.prepare_for_device(x, params)
        return self.embedding.forward(x, params)

    def run_layers(self, x: Any, params: dict[str, Any]) -> Any:
        """``Model.forward_ls`` from the first block on (the same residual deferral between blocks)."""
        from exllamav3.modules.transformer import TransformerBlock

        mods = self.layers
        for i, (module, instance, _) in enumerate(mods):
            params["layer_instance"] = instance
            x = module.prepare_for_device(x, params)
            nxt: Any = mods[i + 1][0] if i + 1 < len(mods) else None
            params["resid_defer"] = (
                type(module) is TransformerBlock and type(nxt) is TransformerBlock and nxt.device == module.device
            )
            x = module.forward(x, params)
        params.pop("resid_defer", None)
        pending = params.pop("resid_pending", None)
        if pending is not None:
            x += pending
        return x

    @contextmanager
    def own_graphs_off(self) -> Iterator[None]:
        """exllamav3's own per-layer graphs (attention blocks, the MLP's 1..8-row paths) stand aside meanwhile.

        Inside a capture of the whole step their launch sequences are recorded as eager kernels; a graph of theirs
        would nest in ours (and their first call synchronizes the device, which a capture forbids). The attention
        switch is a module global of exllamav3's: another model in the same process that steps during a capture (at
        load with ``warmup``, or a step of a new shape) takes exllamav3's eager attention for that step (our steps
        captured this way gave its graphed path's greedy tokens in every comparison run; a server runs each model in
        its own engine process).
        """
        import exllamav3.modules.attn as attn_module
        from exllamav3.modules.mlp import MLP, GatedMLP

        mlps = [m for m in _walk(self.model.modules) if type(m) in (MLP, GatedMLP) and getattr(m, "bc", None)]
        saved, attn_module._bc_attn_enable = attn_module._bc_attn_enable, False
        bcs = [(m, m.bc) for m in mlps]
        try:
            for m, _ in bcs:
                m.bc = None
            yield
        finally:
            attn_module._bc_attn_enable = saved
            for m, bc in bcs:
                m.bc = bc

    def sliced_qkv(self) -> list[Any]:
        """The model's sliced Q/K/V GEMMs (whose output-pointer table exllamav3 builds with a pageable copy)."""
        from exllamav3.modules.multilinear import SlicedMultiLinear

        return [
            mq
            for module in _walk(self.model.modules)
            if isinstance(mq := getattr(module, "multi_qkv", None), SlicedMultiLinear)
        ]


def qkv_pointers(mq: Any, outputs: list[Any]) -> tuple[int, ...]:
    """The output addresses a sliced Q/K/V GEMM writes, for ``outputs`` (``SlicedMultiLinear.c_ptrs``'s table)."""
    return tuple(
        outputs[t].data_ptr() + n0 * outputs[t].element_size()
        for t, n0 in zip(mq.slice_targets, mq.slice_offsets, strict=True)
    )


def _walk(modules: list[Any]) -> Iterator[Any]:
    for m in modules:
        yield m
        yield from _walk(list(getattr(m, "modules", []) or []))


class NoPartialPages:
    """The page table as a ``deterministic`` job's ``Job.prefill`` sees it: no page to copy a partial page from.

    Its one read of ``all_pages`` (a search for a cached page whose first tokens match the rest of the prompt, to
    copy their K/V) finds none; every other read and write reaches the real table.
    """

    __slots__ = ("_table",)
    all_pages: tuple[Any, ...] = ()

    def __init__(self, table: Any) -> None:
        object.__setattr__(self, "_table", table)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._table, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._table, name, value)


# ---------------------------------------------------------------------- the hooks, installed as one unit


class Hooks(Protocol):
    """What the fast path does at each point the seam wraps (``eager``: exllamav3's own call)."""

    def step(self, drafted: bool) -> Any:
        """A context for one ``iterate_gen`` (a decode step; ``drafted``: a window of draft tokens)."""

    def forward(self, eager: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...

    def prefill_chunk(self, eager: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...

    def copy_page(self, eager: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...

    def tokens_read(self, ids: list[int]) -> None:
        """The step's tokens are on the host (exllamav3 read them back and synchronized)."""

    def iterate_end(self) -> None:
        """The end of ``Generator.iterate()`` (nothing is held between calls)."""


class Seam:
    """Every wrap of one exllamav3 generator, installed as one unit and removed as one unit."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator
        self.jobs = GeneratorView(generator)
        self._undo: list[tuple[Any, str, bool, Any]] = []  # (object, name, had an instance value, that value)
        self._job_wraps: weakref.WeakSet[Any] = weakref.WeakSet()  # adopted jobs still alive
        self._pinned: weakref.WeakSet[Any] = weakref.WeakSet()  # deterministic: jobs whose prefill ignores history
        self.private_pages = 0  # deterministic: pages completed while decoding, kept from later prompts
        self.own_forward: Callable[..., Any] = generator.model.forward  # exllamav3's own Model.forward

    def _wrap(self, obj: Any, name: str, new: Any) -> None:
        had = name in vars(obj)
        self._undo.append((obj, name, had, vars(obj).get(name)))
        setattr(obj, name, new)  # an instance attribute shadows the class's method

    def install(
        self, hooks: Hooks, prefill: bool, pointer_table: Callable[[Any], Any] | None, deterministic: bool = False
    ) -> None:
        """Wrap the generator, its model and cache for ``hooks``: all or nothing.

        ``prefill``: also ``Model.prefill`` and ``Cache.copy_page``; ``pointer_table(mq)``: a ``c_ptrs`` for each sliced
        Q/K/V GEMM; ``deterministic``: every job's prefill ignores what was cached before it (:meth:`pin`; the
        generator must prefill one page a forward).

        Raises:
            ValueError: ``deterministic`` with a generator whose prefill chunks are not one page.
        """
        gen = self.generator
        model, cache = gen.model, gen.cache
        if deterministic and (gen.max_chunk_size, gen.shared_chunk_size) != (PAGE_SIZE, PAGE_SIZE):
            raise ValueError(
                f"deterministic=True prefills one page a forward: the Generator's max_chunk_size and shared_chunk_size "
                f"must be {PAGE_SIZE} (they are {gen.max_chunk_size} and {gen.shared_chunk_size})"
            )
        try:
            iterate, iterate_gen, forward = gen.iterate, gen.iterate_gen, model.forward
            self.own_forward = forward

            def fast_iterate(*args: Any, **kwargs: Any) -> Any:
                if deterministic:  # jobs enqueued since: before iterate() starts and prefills them
                    for job in (*gen.pending_jobs, *gen.active_jobs):
                        if job not in self._pinned:
                            self.pin(job)
                try:
                    return iterate(*args, **kwargs)
                finally:
                    hooks.iterate_end()

            def fast_iterate_gen(results: list[Any], draft_tokens: Any = None) -> Any:
                with hooks.step(draft_tokens is not None):
                    return iterate_gen(results, draft_tokens)

            self._wrap(gen, "iterate", fast_iterate)
            self._wrap(gen, "iterate_gen", fast_iterate_gen)
            self._wrap(model, "forward", lambda *a, **k: hooks.forward(forward, a, k))
            prefetch = model.prefetch_tokens

            def prefetch_tokens(ids: list[int]) -> None:
                prefetch(ids)
                hooks.tokens_read(ids)

            self._wrap(model, "prefetch_tokens", prefetch_tokens)
            if prefill:
                own_prefill, copy_page = model.prefill, cache.copy_page
                self._wrap(model, "prefill", lambda *a, **k: hooks.prefill_chunk(own_prefill, a, k))
                self._wrap(cache, "copy_page", lambda *a, **k: hooks.copy_page(copy_page, a, k))
            if pointer_table is not None:
                for mq in ModelView(model).sliced_qkv() if ModelView(model).why_not is None else []:
                    if "c_ptrs" not in vars(mq):
                        self._wrap(mq, "c_ptrs", pointer_table(mq))
        except Exception:
            self.remove()
            raise

    def adopt(self, job: Any, token_for: Callable[[Any], Any]) -> None:
        """``job``'s tokens come from ``token_for(job)`` where it gives one, else from exllamav3's own sampler."""
        own = job.receive_logits

        def receive_logits(logits: Any) -> Any:
            token = token_for(job)
            if token is None:
                return own(logits)
            return token, None, None, None

        self._job_wraps.add(job)
        job.receive_logits = receive_logits

    def pin(self, job: Any) -> None:
        """``job``'s prompt is prefilled as on a fresh cache, whatever was cached before (``deterministic=True``).

        With one page a forward, a page's K/V is computed in a forward of its own tokens after the same pages: cached
        full pages are those a cold run computes; no partial page is copied (:class:`NoPartialPages`); and a page the
        job completes while decoding keeps its private hash (decode steps of one row computed it, a cold run of a
        later prompt computes it in one forward): exllamav3's ``hash_completed_page`` less the publishing, the next
        page linked as ``receive_sample`` links a page whose hash it defers.
        """
        own_prefill, own_hash = job.prefill, job.hash_completed_page
        prefilling = [False]

        def prefill(results: list[Any], chunk_size: int | None = None) -> Any:
            table = job.pagetable
            job.pagetable, prefilling[0] = NoPartialPages(table), True
            try:
                return own_prefill(results, chunk_size)
            finally:
                job.pagetable, prefilling[0] = table, False

        def hash_completed_page(seq: Any, page_idx: int) -> Any:
            if prefilling[0]:  # a prompt page prefill computed in one forward
                return own_hash(seq, page_idx)
            self.private_pages += 1
            pages = seq.allocated_pages
            if page_idx + 1 < len(pages):
                pages[page_idx + 1].prev_hash, pages[page_idx + 1].can_revert = pages[page_idx].phash, False
            return None

        self._pinned.add(job)
        job.prefill, job.hash_completed_page = prefill, hash_completed_page

    def remove(self) -> None:
        """Undo every wrap, newest first (idempotent; never raises)."""
        while self._undo:
            obj, name, had, old = self._undo.pop()
            try:
                if had:
                    setattr(obj, name, old)
                else:
                    vars(obj).pop(name, None)
            except Exception:  # noqa: BLE001 - the other wraps must still go
                logger.exception("decode='fast': removing the wrap of %s", name)
        for job in list(self._job_wraps):
            vars(job).pop("receive_logits", None)
        self._job_wraps.clear()
        for job in list(self._pinned):
            vars(job).pop("prefill", None)
            vars(job).pop("hash_completed_page", None)
        self._pinned.clear()

    @property
    def installed(self) -> bool:
        return bool(self._undo)
