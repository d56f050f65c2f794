"""The fast path's one seam onto exllamav3: what it relies on, the rule for a release, and deterministic prefill.

The requirements are checked against the installed exllamav3's source where it is installed (the GPU machine), and
against the recorded facts of the verified release (read from exllamav3 1.6.5's own source) where it is not.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from exllama_integrations.backends.exllamav3.fast.requirements import (
    PAGE_SIZE,
    PINNED,
    REQUIREMENTS,
    UNVERIFIED_ENV,
    VERIFIED,
    release_stands_aside,
)
from exllama_integrations.backends.exllamav3.upstream import depends

VERIFIED_165 = depends.recorded("1.6.5")


def test_a_cuda_wheels_local_label_is_the_same_release() -> None:
    assert depends.release("1.6.5+cu128.torch2.9.0") == (1, 6, 5)
    assert release_stands_aside("1.6.5+cu128.torch2.9.0", []) is None  # exllamav3's own CUDA release wheels
    assert release_stands_aside("1.6.5", []) is None
    assert (1, 6, 5) in VERIFIED


def test_another_release_stands_aside_with_its_reason_unless_tried_on_purpose() -> None:
    why = release_stands_aside("1.6.6", [])
    assert why is not None and "1.6.6 is not a verified release (verified: 1.6.5)" in why and UNVERIFIED_ENV in why
    assert release_stands_aside("1.6.6", [], unverified_ok=True) is None  # the runbook's trial of a new release
    lacks = release_stands_aside("1.6.6", ["exllamav3.model.model:Model.forward: missing"], unverified_ok=True)
    assert lacks is not None and "Model.forward: missing" in lacks  # never past a requirement it does not meet
    assert release_stands_aside(None, None) == "exllamav3 is not installed"
    assert "not a PEP 440 version" in (release_stands_aside("nightly", []) or "")
    assert "could not be read" in (release_stands_aside("1.6.5", None) or "")


def test_the_verified_release_meets_every_requirement() -> None:
    assert VERIFIED_165 is not None and VERIFIED_165["exllamav3"] == "1.6.5"
    assert depends.problems(REQUIREMENTS, VERIFIED_165["facts"]) == []
    assert {r.key for r in REQUIREMENTS} <= set(VERIFIED_165["facts"])  # every requirement was recorded
    assert VERIFIED_165["facts"]["exllamav3.constants:PAGE_SIZE"]["value"] == PAGE_SIZE  # one page size, checked


def test_the_installed_exllamav3_is_read_from_its_source() -> None:
    root = depends.source_root("exllamav3")
    if root is None:
        pytest.skip("exllamav3 is not installed here (the recorded 1.6.5 facts are checked above)")
    from exllama_integrations.backends.exllamav3.upstream.requirements import REQUIREMENTS as BACKEND

    version = depends.installed_version("exllamav3")
    ours = [*REQUIREMENTS, *PINNED, *BACKEND]  # the fast path's (its pinned strategy's too) and the backend's
    found = depends.facts(root, ours)
    assert set(found) == {r.key for r in ours}
    if depends.release(version or "") == (1, 6, 5):
        assert VERIFIED_165 is not None and found == VERIFIED_165["facts"]  # the recording is of this very source


def test_a_release_that_changed_what_the_seam_wraps_is_named() -> None:
    assert VERIFIED_165 is not None
    facts = copy.deepcopy(VERIFIED_165["facts"])
    facts["exllamav3.generator.generator:Generator.iterate_gen"]["params"] = ["results", "draft", "window"]
    facts["exllamav3.generator.generator:Generator.iterate_gen:params"]["keys"].append("sparse_flag")
    facts["exllamav3.generator.job:Job.receive_logits"]["present"] = False
    facts["exllamav3.constants:PAGE_SIZE"]["value"] = 128
    facts["exllamav3.generator.job:Job.prefill:reads self.pagetable.all_pages"]["reads"] = 2
    got = depends.problems(REQUIREMENTS, facts)
    assert got == [
        "exllamav3.generator.generator:Generator.iterate_gen: parameters ['results', 'draft', 'window'] do not begin "
        "with ['results', 'draft_tokens']",
        "exllamav3.generator.job:Job.receive_logits: missing",
        "exllamav3.generator.job:Job.prefill:reads self.pagetable.all_pages: read 2 times, the seam assumes 1",
        "exllamav3.generator.generator:Generator.iterate_gen:params: keys ['sparse_flag'] are new (the captured "
        "forward lacks them)",
        "exllamav3.constants:PAGE_SIZE: is 128, the fast path assumes 256",
    ]
    why = release_stands_aside("1.6.6", got, unverified_ok=True)
    assert why is not None and why.startswith("exllamav3 1.6.6 lacks what the fast path relies on: ")
    assert set(depends.changed(VERIFIED_165["facts"], facts)) == {
        "exllamav3.generator.generator:Generator.iterate_gen",
        "exllamav3.generator.generator:Generator.iterate_gen:params",
        "exllamav3.generator.job:Job.receive_logits",
        "exllamav3.constants:PAGE_SIZE",
        "exllamav3.generator.job:Job.prefill:reads self.pagetable.all_pages",
    }


def test_the_source_reader_finds_members_signatures_keys_and_constants(tmp_path: Path) -> None:
    pkg = tmp_path / "lib"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "gen.py").write_text(
        "from .x import enabled as _on\nPAGE = 64\n\n"
        "class Gen:\n    limit: int\n    def __init__(self, model, **kw):\n        self.jobs = []\n"
        "    def step(self, results, draft=None):\n        '''doc'''\n        params = {'a': 1, 'b': 2}\n"
        "        return params\n"
    )
    reqs: list[depends.Requirement] = [
        depends.Member("lib.sub.gen", "Gen", "jobs"),
        depends.Member("lib.sub.gen", "Gen", "limit"),
        depends.Member("lib.sub.gen", "Gen", "step", ("results", "draft")),
        depends.Member("lib.sub.gen", "Gen", "gone"),
        depends.DictKeys("lib.sub.gen", "Gen", "step", "params", frozenset({"a"})),
        depends.Constant("lib.sub.gen", "_on"),
        depends.Constant("lib.sub.gen", "PAGE", 64),
        depends.Member("lib.missing", "X", "y"),
        depends.Reads("lib.sub.gen", "Gen", "__init__", "self.jobs"),
        depends.Reads("lib.sub.gen", "Gen", "step", "self.jobs"),
    ]
    found = depends.facts(pkg, reqs)
    assert found["lib.sub.gen:Gen.step"]["params"] == ["results", "draft"]
    assert depends.problems(reqs, found) == [
        "lib.sub.gen:Gen.gone: missing",
        "lib.sub.gen:Gen.step:params: keys ['b'] are new (the captured forward lacks them)",
        "lib.missing:X.y: missing",
        "lib.sub.gen:Gen.step:reads self.jobs: read 0 times, the seam assumes 1",
    ]
    # a docstring or comment edit is not a change of code; a changed line is
    before = found["lib.sub.gen:Gen.step"]["body"]
    src = (pkg / "sub" / "gen.py").read_text()
    (pkg / "sub" / "gen.py").write_text(src.replace("'''doc'''", "'''another doc'''  # note"))
    assert depends.facts(pkg, reqs)["lib.sub.gen:Gen.step"]["body"] == before
    (pkg / "sub" / "gen.py").write_text(src.replace("return params", "return dict(params)"))
    assert depends.facts(pkg, reqs)["lib.sub.gen:Gen.step"]["body"] != before


def test_the_recorded_facts_are_what_the_reader_makes_of_1_6_5() -> None:
    """The recording is the reader's own output (written by ``python -m ...fast --record``), not edited by hand."""
    path = depends.RECORDED / "exllamav3-1.6.5.json"
    text = path.read_text()
    assert text == json.dumps(json.loads(text), indent=1, sort_keys=True) + "\n"


# ---------------------------------------------------------------------- options the installed exllamav3 would ignore


class Generator163:
    """exllamav3 1.6.3's Generator: no prefill_cooldown or shared_chunk_size, both swallowed by ``**kwargs``."""

    def __init__(self, model: object, cache: object, tokenizer: object, max_batch_size: int = 256, **kwargs: object):
        pass


def test_an_option_the_installed_generator_would_ignore_is_refused_typed(caplog: pytest.LogCaptureFixture) -> None:
    from exllama_integrations import InvalidSettingsError
    from exllama_integrations.backends.exllamav3.options import (
        IGNORED_BY_OLD_RELEASES,
        ExLlamaV3Options,
        generator_kwargs,
        generator_parameters,
    )

    old = generator_parameters(Generator163)
    assert old is not None and "kwargs" not in old and not set(IGNORED_BY_OLD_RELEASES) & old
    with pytest.raises(InvalidSettingsError, match="prefill_cooldown is not an argument of the installed") as e:
        generator_kwargs(ExLlamaV3Options(prefill_cooldown=4), 2048, old)
    assert e.value.param == "prefill_cooldown"
    kw = generator_kwargs(ExLlamaV3Options(), 2048, old)  # our defaults, not the user's: dropped, and said
    assert not set(IGNORED_BY_OLD_RELEASES) & set(kw) and "has no prefill_cooldown" in caplog.text
    assert VERIFIED_165 is not None
    new = set(VERIFIED_165["facts"]["exllamav3.generator.generator:Generator.__init__"]["params"])
    assert set(IGNORED_BY_OLD_RELEASES) <= new  # the verified release takes both: passed as they are
    assert {"prefill_cooldown": 0, "shared_chunk_size": 2048}.items() <= generator_kwargs(
        ExLlamaV3Options(), 2048, new
    ).items()


def test_deterministic_decoding_refuses_what_would_break_its_guarantee() -> None:
    from exllama_integrations import InvalidSettingsError
    from exllama_integrations.backends.base import build_options
    from exllama_integrations.backends.exllamav3.options import ExLlamaV3Options

    with pytest.raises(InvalidSettingsError, match="deterministic=True prefills job by job"):
        build_options(ExLlamaV3Options, "exllamav3", {"deterministic": True, "prefill": "batched"})
    with pytest.raises(InvalidSettingsError, match="deterministic=True needs decode='fast'"):
        build_options(ExLlamaV3Options, "exllamav3", {"deterministic": True, "decode": "exllamav3"})
    opts = build_options(ExLlamaV3Options, "exllamav3", {"deterministic": True})
    assert isinstance(opts, ExLlamaV3Options) and opts.prefill == "exllamav3"
    assert ExLlamaV3Options().prefill == "exllamav3"  # job by job by default: tokens independent of neighbours


# ---------------------------------------------------------------------- deterministic=True: prefill without history


def test_deterministic_prefills_in_whole_page_chunks_and_refuses_a_chunk_that_contradicts_it() -> None:
    from exllama_integrations import InvalidSettingsError
    from exllama_integrations.backends.base import build_options
    from exllama_integrations.backends.exllamav3.options import ExLlamaV3Options, generator_kwargs, prefill_chunk

    det = ExLlamaV3Options(deterministic=True)
    assert prefill_chunk(det, 65536) == 2048  # exllamav3's own chunk: a cold prompt in as many forwards as the default
    kw = generator_kwargs(det, prefill_chunk(det, 65536))
    assert (kw["max_chunk_size"], kw["shared_chunk_size"]) == (2048, 2048)  # the same chunks while others decode
    assert prefill_chunk(det, 1024) == 1024 and prefill_chunk(ExLlamaV3Options(), 1024) == 1024
    same = {"deterministic": True, "max_chunk_size": 512, "shared_chunk_size": 512}
    opts = build_options(ExLlamaV3Options, "exllamav3", same)
    assert isinstance(opts, ExLlamaV3Options) and prefill_chunk(opts, 65536) == 512
    assert generator_kwargs(opts, 512)["shared_chunk_size"] == 512
    with pytest.raises(InvalidSettingsError, match="whole pages.*max_chunk_size=300 is not") as e:
        build_options(ExLlamaV3Options, "exllamav3", {"deterministic": True, "max_chunk_size": 300})
    assert "choose a multiple of 256" in str(e.value)
    for asked in ({"shared_chunk_size": 512}, {"max_chunk_size": 1024, "shared_chunk_size": 512}):
        with pytest.raises(InvalidSettingsError, match="same chunks while others decode.*leave shared_chunk_size"):
            build_options(ExLlamaV3Options, "exllamav3", {"deterministic": True, **asked})
        assert build_options(ExLlamaV3Options, "exllamav3", asked)  # without deterministic: as asked


class Page:
    """A cache page as exllamav3's ``CachePage`` keeps it (the fields the seam and prefill read)."""

    def __init__(self, tokens: list[int], phash: str, prev_hash: str | None = None) -> None:
        self.tokens, self.phash, self.prev_hash, self.can_revert = tokens, phash, prev_hash, True


class PageTable:
    def __init__(self, pages: list[Page]) -> None:
        self.all_pages, self.referenced_pages = pages, {p.phash: p for p in pages}


class Seq:
    def __init__(self, pages: list[Page]) -> None:
        self.allocated_pages = pages


class HistoryJob:
    """exllamav3's ``Job`` in miniature, at the two points where its prefill depends on the cache's history.

    ``prefill``: copies the K/V of the cached page whose first tokens match most of the prompt (``Job.prefill``'s
    partial-page search over ``self.pagetable.all_pages``) and hashes the prompt page it completes;
    ``hash_completed_page``: publishes a completed page under its content hash and links the next one.
    """

    def __init__(self, gen: FakeGenerator, prompt: list[int]) -> None:
        self.pagetable, self.prompt, self.copied = gen.pagetable, prompt, 0
        self.seq = Seq([Page(prompt, "private-0"), Page([], "private-1"), Page([], "private-2")])

    def prefill(self, results: list[object], chunk_size: int | None = None) -> None:
        def match(p: Page) -> int:
            return next((i for i, (a, b) in enumerate(zip(p.tokens, self.prompt, strict=False)) if a != b), 0)

        self.copied = max([match(p) for p in self.pagetable.all_pages] + [0])
        assert self.pagetable.referenced_pages  # the rest of the table is there as ever
        self.hash_completed_page(self.seq, 0)  # a prompt page this prefill computed

    def hash_completed_page(self, seq: Seq, page_idx: int) -> None:
        page = seq.allocated_pages[page_idx]
        page.phash = f"content-{page_idx}"
        self.pagetable.referenced_pages[page.phash] = page
        seq.allocated_pages[page_idx + 1].prev_hash, seq.allocated_pages[page_idx + 1].can_revert = page.phash, False


class FakeGenerator:
    """exllamav3's ``Generator.iterate`` in miniature: start pending jobs, prefill them, a decode step completes a
    page of each (``receive_sample`` calls ``hash_completed_page``)."""

    def __init__(self, chunk: int = PAGE_SIZE) -> None:
        self.max_chunk_size = self.shared_chunk_size = chunk
        self.recurrent_cache = None
        self.pagetable = PageTable([Page([5, 6, 7, 8], "content-other")])
        self.pending_jobs: list[HistoryJob] = []
        self.active_jobs: list[HistoryJob] = []
        self.model = type("M", (), {"forward": lambda *a, **k: None, "prefetch_tokens": lambda *a: None})()
        self.cache = type("C", (), {"copy_page": lambda *a: None})()

    def iterate(self) -> list[object]:
        self.active_jobs += self.pending_jobs
        self.pending_jobs = []
        for job in self.active_jobs:
            job.prefill([])
        self.iterate_gen([])
        return []

    def iterate_gen(self, results: list[object], draft_tokens: object = None) -> None:
        for job in self.active_jobs:
            job.hash_completed_page(job.seq, 1)  # the page straddling the prompt's end, completed while decoding


class NoHooks:
    def step(self, drafted: bool) -> object:
        from contextlib import nullcontext

        return nullcontext()

    def forward(self, call: object) -> object:
        return None

    def tokens_read(self, ids: list[int]) -> None:
        pass

    def iterate_end(self) -> None:
        pass


def test_deterministic_prefill_copies_no_partial_page_and_keeps_decoded_pages_private() -> None:
    from exllama_integrations.backends.exllamav3.fast.seam import Seam

    gen = FakeGenerator()
    gen.pending_jobs.append(warm := HistoryJob(gen, [5, 6, 7, 9]))
    gen.iterate()  # exllamav3 alone: 3 tokens' K/V copied from another prompt's page, the decoded page published
    assert warm.copied == 3 and warm.seq.allocated_pages[1].phash == "content-1"

    gen = FakeGenerator()
    seam = Seam(gen)
    seam.install(NoHooks(), prefill=False, pointer_table=None, deterministic=True)  # type: ignore[arg-type]
    gen.pending_jobs.append(job := HistoryJob(gen, [5, 6, 7, 9]))
    gen.iterate()
    assert job.copied == 0  # no partial page copied: the prompt is prefilled as on a fresh cache
    assert job.pagetable is gen.pagetable  # the view lasted the prefill only
    pages = job.seq.allocated_pages
    assert pages[0].phash == "content-0"  # a prompt page prefill computed in one forward: published as ever
    assert pages[1].phash == "private-1" and "content-1" not in gen.pagetable.referenced_pages  # decoded: private
    assert (pages[2].prev_hash, pages[2].can_revert) == ("private-1", False)  # linked, not reverted at the end
    assert seam.private_pages == 1

    seam.remove()  # with the seam's other wraps
    assert not vars(job).keys() & {"prefill", "hash_completed_page"} and "iterate" not in vars(gen)
    gen.pending_jobs.append(after := HistoryJob(gen, [5, 6, 7, 9]))
    gen.iterate()
    assert after.copied == 3  # exllamav3's own prefill again


def test_deterministic_needs_the_same_whole_page_chunks_and_prefills_in_blocks_where_they_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from exllama_integrations.backends.exllamav3.fast.seam import Seam, prefix

    gen = FakeGenerator(chunk=2048)
    gen.shared_chunk_size = 1024  # a prompt prefilled while others decode would be cut elsewhere
    seam = Seam(gen)
    with pytest.raises(ValueError, match="same multiple of 256 \\(they are 2048 and 1024\\)"):
        seam.install(NoHooks(), prefill=False, pointer_table=None, deterministic=True)  # type: ignore[arg-type]
    assert not seam.installed and "iterate" not in vars(gen)

    gen = FakeGenerator(chunk=2048)  # a model the fast path does not capture (here: exllamav3 is not installed)
    seam = Seam(gen)
    seam.install(NoHooks(), prefill=False, pointer_table=None, deterministic=True)  # type: ignore[arg-type]
    assert (gen.max_chunk_size, gen.shared_chunk_size) == (PAGE_SIZE, PAGE_SIZE)  # one page a forward, and why
    assert seam.blocks()["pages_a_chunk"] == 1 and "does not capture" in seam.blocks()["why"]
    seam.remove()
    assert (gen.max_chunk_size, gen.shared_chunk_size) == (2048, 2048)  # the generator's own again

    monkeypatch.setattr(prefix, "one_page_why", lambda g: None)  # dense layers only
    gen = FakeGenerator(chunk=2048)
    seam = Seam(gen)
    seam.install(NoHooks(), prefill=False, pointer_table=None, deterministic=True)  # type: ignore[arg-type]
    assert gen.max_chunk_size == 2048 and seam.blocks() == {
        "pages_a_chunk": 8,
        "jobs": 0,
        "pages_matched": 0,
        "pages_reused": 0,
        "pages_recomputed": 0,
        "prompt_pages_kept_private": 0,
    }
    seam.remove()
