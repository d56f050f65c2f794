"""The exllamav3 backend's load options (TabbyAPI's names where it has one), and how its cache is sized.

``cache_size="auto"`` takes a fraction of the GPU memory left after the weights (like vLLM's
``gpu_memory_utilization``), at most what ``max_batch_size`` jobs of the full context can use; the other
options become the ``Cache``, ``load()`` and ``Generator`` arguments here, in one place.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from ...errors import InvalidSettingsError
from ..base import BackendOptions
from .fast.requirements import PAGE_SIZE

if TYPE_CHECKING:
    from ...model.directory import ModelDirectory

logger = logging.getLogger(__name__)

PAGE = PAGE_SIZE  # tokens per page of exllamav3's paged cache (fast.requirements: its one source, checked)


def whole_pages(tokens: int) -> int:
    """``tokens`` rounded up to whole cache pages (one page at least)."""
    return max(PAGE, -(-tokens // PAGE) * PAGE)


RESERVE = 4 * 2**30
"""GPU memory left free for activations, prefill chunks and workspace when sizing the cache."""


def cache_bytes_per_token(config: dict[str, Any], cache_bits: int | tuple[int, int] | None) -> float:
    """Bytes one cached token takes: K and V of every layer (fp16, or the quantized bits)."""
    layers = int(config.get("num_hidden_layers") or 1)
    heads = int(config.get("num_attention_heads") or 1)
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config.get("hidden_size") or heads) // heads)
    k, v = cache_bits if isinstance(cache_bits, tuple) else (cache_bits or 16, cache_bits or 16)
    return layers * kv * head_dim * (k + v) / 8


def auto_cache_tokens(
    model: ModelDirectory,
    options: ExLlamaV3Options,
    context: int,
    draft: ModelDirectory | None = None,
    mtp_layers: int = 0,
) -> tuple[int, dict[str, Any]]:
    """The cache size for ``cache_size="auto"``, and how it was chosen (for the log and model info).

    Free memory on the devices the model loads on (at most ``memory_share`` of their total, when several
    runtimes share them), times ``cache_memory``, less the weights (their size on disk) and a reserve for
    activations; at most ``max_batch_size`` jobs of the full context. A draft model's weights and its cache
    (as large as the main one) count too, and so does the cache of ``mtp_layers`` MTP layers (``draft="mtp"``:
    their weights are in the model's files).
    """
    import torch

    devices = range(torch.cuda.device_count()) if options.gpu_split else [torch.cuda.current_device()]
    if options.device and not options.gpu_split:
        devices = [torch.device(options.device).index or 0]
    free_total = [torch.cuda.mem_get_info(d) for d in devices]
    free = sum(min(f, t * options.memory_share) for f, t in free_total)
    models = [model] if draft is None else [model, draft]
    weights = sum(p.stat().st_size for m in models for p in m.weight_files)
    per_token = sum(cache_bytes_per_token(m.text_config, options.cache_bits) for m in models)
    if mtp_layers:
        per_token += cache_bytes_per_token({**model.text_config, "num_hidden_layers": mtp_layers}, options.cache_bits)
    budget = free * options.cache_memory - weights - RESERVE
    most = options.max_batch_size * context
    tokens = max(PAGE, min(int(budget // per_token), most) // PAGE * PAGE)
    why = {
        "free_gib": round(free / 2**30, 1),
        "memory_share": options.memory_share,
        "weights_gib": round(weights / 2**30, 1),
        "bytes_per_token": int(per_token),
        "limited_by": "memory" if budget // per_token < most else "max_batch_size x context",
    }
    return tokens, why


class ExLlamaV3Options(BackendOptions):
    """Load options of the exllamav3 backend (TabbyAPI's names where it has one)."""

    cache_size: int | Literal["auto"] = "auto"
    """Paged-cache tokens shared by all jobs (whole 256-token pages). ``"auto"``: ``cache_memory`` of the GPU
    memory left after the weights (like vLLM's ``gpu_memory_utilization``), at most what ``max_batch_size``
    jobs of the full context can use."""
    vision: bool = True
    """For a vision-language model: load its vision component and take images. False saves its memory."""
    cache_memory: float = Field(default=0.9, gt=0.0, le=0.98)
    """With ``cache_size="auto"``: the fraction of free GPU memory the weights and cache may take."""
    memory_share: float = Field(default=1.0, gt=0.0, le=1.0)
    """With ``cache_size="auto"``: this runtime's share of each GPU's total memory, when several load on it at
    once (``engines=N`` sets 1/N, a Ray replica its fractional ``num_gpus``): each sizes its cache within its
    share instead of from the free memory the others are about to take."""
    cpu_cache_size: int = Field(default=0, ge=0)
    """Bytes of pinned host memory for pages evicted from the GPU cache (kept for prefix reuse); 0: off."""
    disk_cache_dir: str | None = None
    """A folder for a third, persistent tier of cached pages behind ``cpu_cache_size`` (needs it > 0)."""
    cache_bits: int | tuple[int, int] | None = None
    """Quantized K/V cache: bits for both, or ``(k_bits, v_bits)``, each 2..8; None: fp16."""
    gpu_split: list[float] | None = None
    """GB of weights per GPU, in device order (layer split)."""
    max_batch_size: int = Field(default=64, ge=1, le=1024)
    """Most jobs decoding together."""
    max_chunk_size: int | None = Field(default=None, ge=256)
    """Prefill chunk (tokens); None: min(2048, cache). With ``deterministic=True`` a whole number of pages (256)."""
    prefill_cooldown: int | None = Field(default=0, ge=0)
    """Iterations between prefill passes while other jobs decode. 0 (ours): a caller who arrives while others
    decode starts at the next step; exllamav3's own 4 smooths running streams but, measured with 64 callers
    arriving ms apart on the H200, cost 44% of the throughput and 3.5x the time to first token."""
    shared_chunk_size: int | None = Field(default=None, ge=256)
    """Prefill chunk (tokens) while other jobs decode. None (ours): ``max_chunk_size``, so that with
    ``prefill_cooldown`` 0 every prompt waiting starts at the next step, and with ``decode="fast"`` their chunks run
    together in a few forwards (``fast.prefill``, with ``prefill="batched"``). exllamav3's own (half of
    ``max_chunk_size``) takes one waiting prompt a step: 64 callers arriving ms apart then start one step apart,
    each prefilled alone. With ``deterministic=True``: ``max_chunk_size`` (another value is refused)."""
    warmup: bool = False
    """Run exllamav3's ``Model.warmup()`` at load (kernel compiles, GEMM autotuning, graph workspaces), so the first
    request pays none of it; its time is in ``model_info().details["warmup_seconds"]`` (8 s on the H200 for a
    small fp16 model). On by default where a server loads the model (``serve``, Ray replicas), off in process."""
    decode: Literal["exllamav3", "fast"] = "fast"
    """How a decode step runs. ``"exllamav3"``: its own loop (samplers job by job). ``"fast"`` (the default): every job
    whose settings it covers is sampled in one batched pass on the GPU, and the whole decode forward is replayed from a
    CUDA graph captured per batch shape (``fast.graphs``); ``diagnostics()["fast_decode"].report()`` says what fell
    back to exllamav3 and why. Greedy tokens are exllamav3's own (proven on the verified releases); on a release the
    fast path has not verified, or whose source lacks what it relies on, it stands aside and says so."""
    prefill: Literal["batched", "exllamav3"] = "exllamav3"
    """With ``decode="fast"``: how the prompts of one step are prefilled. ``"exllamav3"`` (the default): job by job, as
    exllamav3 does, so that a request's tokens do not depend on what was prefilled beside it. ``"batched"``: their
    chunks run side by side in a few forwards (``fast.prefill``; on the H200, 64 prompts of 128 tokens of a 1B EXL3
    model in 94 ms instead of 546, run 14); the cache then holds the same K/V up to the GEMMs' rounding, so greedy
    tokens may part from exllamav3's own where two logits nearly tie."""
    fast_recurrent: bool = True
    """With ``decode="fast"`` on a Gated DeltaNet hybrid (Qwen3.5 / 3.6 dense): capture its decode steps of more than 8
    rows too (up to 8, exllamav3's own graphed layers run), each row's recurrent state addressed through static slot
    tensors (``fast.graphs``). Greedy tokens exllamav3's own at 1, 16 and 64 jobs on an H100 (2026-12-07,
    ``tests/gpu/family_matrix.py``'s fast phase). False: such a model's forward runs eagerly (the batched sampler
    still runs). Mamba-2 layers (Nemotron-H) are captured the same way, above 8 rows on EXL3 weights (up to 8 its own
    graphed ``BC_Mamba2`` runs) and at every row count on fp16 / bf16 weights (its torch path throughout;
    ``fast.seam.mamba``; greedy tokens against exllamav3's own loop: ``tests/gpu/test_gpu_fast_mamba.py``, 1/8/16/64
    jobs). On a model with sliding-window rings (exllamav3's ``SlidingAttention``: gpt-oss, Gemma 4, MiMo-V2) it
    also captures their decode steps at every row count, each ring's page table and length static tensors the graph
    reads (``fast.seam.rings``; greedy tokens against exllamav3's own loop: ``tests/gpu/test_gpu_fast_rings.py``);
    False: such a model runs eagerly."""
    deterministic: bool = False
    """With ``decode="fast"``: a request's tokens do not depend on what runs beside it (the requests decoding with it,
    their number and order). Each row of a decode step runs as a step of its own, as exllamav3 runs a request alone
    (one forward per row: 0.97 of the default alone, 0.16 at 16 jobs, 0.13 at 64 on an H100), and prompts are
    prefilled job by job in chunks of ``max_chunk_size`` (2,048 tokens) starting on multiples of it from position 0,
    a cached prefix reused in whole chunks only, so that a page's K/V are the same whatever of its prefix was cached
    before; a partly filled cached page is not copied, and a page completed while decoding, or in a prompt's last
    chunk shorter than the others, is not offered to later prompts (docs/determinism.md). Without it (the
    default), tokens are those of exllamav3's own loop for the same schedule, which may part from the same request
    alone at near-ties."""
    progressbar: bool | None = None
    """A progress bar while loading; None: when stderr is a terminal or in a notebook."""
    stream_interval: int | Literal["auto"] = "auto"
    """While other jobs decode too, hand a request its tokens every this many steps (1: every step); its first
    token, and every step of a request with stop strings, at once. ``"auto"``: every step up to 15 jobs
    decoding, then every ``jobs // 8`` steps (64 jobs: 8, 0.1-0.4 s on the H200), so the readers' wake-ups per
    step stay about 8 however many stream (each wakes for a few tokens at a time; one reader takes the GIL the
    driver needs)."""
    arrival_window: float = Field(default=0.002, ge=0.0, le=0.1)
    """Seconds the idle driver waits for more requests after one arrives (until none came for this long,
    at most 50x), so that a burst of calls (a LangChain ``batch``, ``asyncio.gather``) prefills together."""
    burst_window: float | None = Field(default=None, ge=0.0, le=0.1)
    """Once a second request came while the idle driver waited: the quiet it waits for instead of
    ``arrival_window`` (at most 50x). None: ``arrival_window``. A server sets 0.02: its clients' requests reach
    the engine a few ms apart (HTTP, JSON, tokenizing one after another), and a burst that starts in pieces
    decodes out of step (on the H200 a 20 ms window gave 64 streaming clients 1.24x the tokens/s)."""
    lora_dir: str | list[str] | None = None
    """PEFT LoRA adapter directories (adapter_config.json + adapter_model.safetensors), applied to every job."""
    lora_scaling: float | list[float] = 1.0
    """Scale of each adapter (on top of its alpha / r): one for all, or one per ``lora_dir``."""
    draft_model_dir: str | None = None
    """A smaller model with the same vocabulary that drafts tokens for speculative decoding."""
    draft: Literal["mtp"] | None = None
    """``"mtp"``: draft with the checkpoint's own multi-token-prediction heads (Qwen3.5/3.6, GLM, DeepSeek-V4,
    Nemotron-H, MiMo checkpoints that carry them), through exllamav3's MTP drafter; a checkpoint without them is
    refused at load, saying what it lacks (:mod:`.mtp`)."""
    num_draft_tokens: int | None = Field(default=None, ge=1, le=32)
    """Tokens drafted per step with ``draft_model_dir``, ``draft`` or ``ngram_match_min``; None: exllamav3's 4."""
    draft_window: Literal["measured", "fixed"] = "fixed"
    """With a draft model or MTP heads: ``"fixed"`` (the default until the GPU has measured the other) drafts
    ``num_draft_tokens`` every step, as exllamav3 does; ``"measured"`` drafts, each step, the window (0 to
    ``num_draft_tokens``) that gave the most tokens per second on the steps of this batch size so far, so that drafting
    does not make a batch slower (:mod:`.draft_rule`)."""
    ngram_match_min: int = Field(default=0, ge=0, le=64)
    """Speculative decoding with no draft model: draft from the job's own context where its last this many
    tokens occurred before (0: off)."""

    @field_validator("stream_interval")
    @classmethod
    def _interval(cls, v: Any) -> Any:
        if v != "auto" and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 64):
            raise ValueError('stream_interval must be "auto" or an int from 1 to 64')
        return v

    @field_validator("cache_size")
    @classmethod
    def _size(cls, v: Any) -> Any:
        if v != "auto" and (not isinstance(v, int) or isinstance(v, bool) or v < 256):
            raise ValueError('cache_size must be "auto" or an int of at least 256 tokens')
        return v

    @model_validator(mode="after")
    def _extras(self) -> ExLlamaV3Options:
        dirs = self.lora_dirs
        if isinstance(self.lora_scaling, list) and len(self.lora_scaling) != len(dirs):
            raise ValueError(f"lora_scaling has {len(self.lora_scaling)} values for {len(dirs)} lora_dir entries")
        ways = [k for k in ("draft_model_dir", "draft", "ngram_match_min") if getattr(self, k)]
        if len(ways) > 1:
            raise ValueError(f"{' and '.join(ways)} are {len(ways)} ways to draft: choose one")
        if self.num_draft_tokens is not None and not ways:
            raise ValueError("num_draft_tokens needs draft_model_dir, draft='mtp' or ngram_match_min")
        if self.prefill == "batched" and self.decode != "fast":
            raise ValueError(
                "prefill='batched' runs inside the fast decode path: with decode='exllamav3' prompts are prefilled job "
                "by job; leave prefill unset or use decode='fast'"
            )
        if self.disk_cache_dir and not self.cpu_cache_size:
            raise ValueError(
                "disk_cache_dir is the tier behind cpu_cache_size, which is 0 (off): set cpu_cache_size (bytes of "
                "host memory, e.g. 4294967296) too, or leave disk_cache_dir unset"
            )
        if self.deterministic and self.decode != "fast":
            raise ValueError("deterministic=True needs decode='fast' (the rows of a step run apart there)")
        if self.deterministic and self.prefill == "batched":
            raise ValueError("deterministic=True prefills job by job: leave prefill='exllamav3'")
        chunk, shared = self.max_chunk_size, self.shared_chunk_size
        if self.deterministic and chunk is not None and chunk % PAGE:
            raise ValueError(
                f"deterministic=True prefills in chunks of whole pages ({PAGE} tokens) from position 0, so that a "
                f"prompt's K/V do not depend on what was cached before it; max_chunk_size={chunk} is not: choose a "
                f"multiple of {PAGE}, or leave max_chunk_size unset"
            )
        if self.deterministic and shared is not None and shared != chunk:
            raise ValueError(
                f"deterministic=True prefills a prompt in the same chunks while others decode, so that its K/V do "
                f"not depend on them; shared_chunk_size={shared} contradicts it: leave shared_chunk_size unset"
            )
        if self.deterministic and ways:
            raise ValueError(
                f"deterministic=True runs the rows of a decode step apart, but a drafted step ({ways[0]}) verifies "
                "every job's window in one forward, where rows part at near-ties: choose one"
            )
        return self

    @property
    def drafting(self) -> bool:
        """Whether a step drafts tokens (a draft model, MTP heads or n-grams)."""
        return bool(self.draft_model_dir or self.draft or self.ngram_match_min)

    @property
    def lora_dirs(self) -> list[str]:
        """``lora_dir`` as a list."""
        return [self.lora_dir] if isinstance(self.lora_dir, str) else list(self.lora_dir or [])

    @property
    def lora_scalings(self) -> list[float]:
        """One scale per adapter."""
        s = self.lora_scaling
        return list(s) if isinstance(s, list) else [float(s)] * len(self.lora_dirs)

    @field_validator("cache_bits")
    @classmethod
    def _bits(cls, v: Any) -> Any:
        pair = v if isinstance(v, tuple) else (v, v)
        if v is not None and not all(isinstance(b, int) and 2 <= b <= 8 for b in pair):
            raise ValueError("cache_bits must be 2..8, or a (k_bits, v_bits) pair of those")
        return v


def cache_kwargs(options: ExLlamaV3Options, default_draft: int = 4) -> dict[str, Any]:
    """exllamav3 ``Cache`` arguments for ``cache_bits`` (none: fp16), and the rollback room drafting needs.

    A recurrent model (Qwen3.5's Gated DeltaNet layers, Mamba) verifies a drafted window and rolls its state back
    over the rejected part: exllamav3 refuses a speculative pass longer than the cache's ``max_history``, which is
    ``num_draft_tokens``, else the drafter's ``default_draft`` (exllamav3's 4; an MTP head's own, 1 to 4).
    """
    kw: dict[str, Any] = {"max_history": options.num_draft_tokens or default_draft} if options.drafting else {}
    if options.cache_bits is None:
        return kw
    from .upstream import CacheLayer_quant

    k, v = options.cache_bits if isinstance(options.cache_bits, tuple) else (options.cache_bits,) * 2
    return {**kw, "layer_type": CacheLayer_quant, "k_bits": k, "v_bits": v}


IGNORED_BY_OLD_RELEASES = ("prefill_cooldown", "shared_chunk_size")
"""Generator arguments exllamav3 before 1.6.4 does not have: it takes them in ``**kwargs`` and ignores them."""


def prefill_chunk(options: ExLlamaV3Options, cache_tokens: int) -> int:
    """The longest prefill forward (tokens): ``max_chunk_size`` (None: 2048) within the cache.

    Whole pages when ``deterministic`` (the chunks then start on multiples of it, cold or warm: fast/chunk_plan.py).
    """
    chunk = min(options.max_chunk_size or 2048, cache_tokens)
    return max(PAGE, chunk // PAGE * PAGE) if options.deterministic else chunk


def generator_kwargs(options: ExLlamaV3Options, chunk: int, accepted: set[str] | None = None) -> dict[str, Any]:
    """exllamav3 ``Generator`` arguments from our options (a draft model is added by the caller).

    ``accepted``: the arguments the installed ``Generator`` names (None: all). An option the user set that it would
    ignore is refused; one of ours left at its default is dropped (and logged).

    Raises:
        InvalidSettingsError: the user set an option the installed exllamav3 would ignore.
    """
    kw: dict[str, Any] = {"max_batch_size": options.max_batch_size, "max_chunk_size": chunk}
    if options.prefill_cooldown is not None:
        kw["prefill_cooldown"] = options.prefill_cooldown
    page = PAGE  # a shared chunk is whole pages, at most max_chunk_size
    kw["shared_chunk_size"] = max(page, min(options.shared_chunk_size or chunk, chunk) // page * page)
    if options.deterministic:  # the same chunks while others decode (a value that contradicts it is refused)
        kw["shared_chunk_size"] = chunk
    for name in IGNORED_BY_OLD_RELEASES:
        if accepted is None or name in accepted:
            continue
        if name in options.model_fields_set:
            raise InvalidSettingsError(
                f"{name} is not an argument of the installed exllamav3's Generator, which would ignore it: "
                "install exllamav3 >= 1.6.4, or leave it unset.",
                param=name,
            )
        kw.pop(name, None)
        logger.warning("exllamav3: this release's Generator has no %s; its own default applies", name)
    if options.ngram_match_min:
        kw["ngram_match_min"] = options.ngram_match_min
    if options.num_draft_tokens is not None:
        kw["num_draft_tokens"] = options.num_draft_tokens
    if options.cpu_cache_size:
        kw["cpu_cache_size"] = options.cpu_cache_size
        if options.disk_cache_dir:
            kw["disk_cache_dir"] = options.disk_cache_dir
    return kw


def show_progress(option: bool | None) -> bool:
    """Whether to show a progress bar while loading (``None``: when stderr is a terminal, or in a notebook)."""
    if option is not None:
        return option
    return bool(getattr(sys.stderr, "isatty", lambda: False)()) or _in_notebook()


def _in_notebook() -> bool:
    """Whether this code runs in a Jupyter kernel.

    Not merely in a process that imported ipykernel (a test run that executed a notebook, a tool that vendors it).
    """
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)() if ipython is not None else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def generator_parameters(generator_class: Any) -> set[str] | None:
    """The argument names ``generator_class.__init__`` declares (None: it declares none we could read)."""
    import inspect

    try:
        params = inspect.signature(generator_class.__init__).parameters
    except (TypeError, ValueError):
        return None
    return {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
