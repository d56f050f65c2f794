"""The README's and docs pages' Python examples run as written on CPU, and each one's claims are asserted.

Blocks run in order in one namespace: the README's first, then each page of docs/ in name order (a page's
examples continue from the README's); every block must have a check below (a new example without one fails),
keyed by a line that only that block has. The README stays on two screens above its table of contents, one example
per door; every relative link in these pages leads to a file and a heading that exist.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCKS = [
    (str(page.relative_to(ROOT)), block)
    for page in PAGES
    for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
]


def _model_dir(ns, out):
    assert Path(ns["model_dir"], "config.json").is_file()


def _llm(ns, out):
    assert "Paris" in out
    text = "How many tokens is this?"
    assert ns["n"] == len(ns["llm"].exllama_runtime.encode(text)) > 0


def _chat(ns, out):
    msg, chat = ns["msg"], ns["chat"]
    assert "Paris" in msg.content and msg.response_metadata["finish_reason"] == "stop"
    prompt_tokens = chat.get_num_tokens_from_messages(
        [("system", "Be brief."), ("human", "What is the capital of France?")]
    )
    assert msg.usage_metadata["input_tokens"] == prompt_tokens
    call = ns["call"].tool_calls[0]
    assert call["name"] == "add" and call["args"] == {"a": 2, "b": 3} and call["id"].startswith("call_")
    assert f"'name': 'add', 'args': {{'a': 2, 'b': 3}}, 'id': '{call['id']}'" in out  # what the comment shows


def _structured(ns, out):
    assert "name='Paris'" in out and "country=" in out and "is_capital=" in out  # a City, held to its schema


def _from_model_id(ns, out):
    assert "Paris" in out and ns["llm"].temperature == 0.0


def _llama_index(ns, out):
    counter, answer = ns["counter"], ns["answer"]
    assert "Paris" in str(answer)
    assert f"{counter.prompt_llm_token_count} {counter.completion_llm_token_count}" in out
    assert counter.prompt_llm_token_count > 20  # the rendered prompt, counted by the model's tokenizer
    n = len(ns["li_llm"].tokenizer_fn(str(answer)))
    assert counter.completion_llm_token_count in (n, n + 1)  # + the end-of-turn token when it ended there


def _runtime(ns, out):
    r, rt = ns["r"], ns["rt"]
    assert "Paris" in r.text and r.finish_reason in ("eos", "length")
    assert r.usage.prompt_tokens == len(rt.encode("The capital of France is", add_special_tokens=True))
    assert r.timings.time_to_first_token > 0
    whole = rt.generate("One, two,", temperature=0, max_tokens=6).text
    assert out.rstrip("\n").endswith(whole)  # the request value gives what the conveniences give


def _reasoning(ns, out):
    reply, city, thinker = ns["reply"], ns["city"], ns["thinker"]
    thought = reply.additional_kwargs["reasoning_content"]
    assert thought and thought in out and "<think>" not in reply.content and "</think>" not in reply.content
    assert 6 <= reply.usage_metadata["output_token_details"]["reasoning"] <= 9  # the budget, then "</think>"
    assert f"{reply.usage_metadata['output_token_details']}" in out
    assert isinstance(city, ns["City"]) and city.name
    assert thinker.profile["reasoning_output"] is True
    assert thinker.profile["max_input_tokens"] == thinker.exllama_runtime.model_info().context_length


def _agent(ns, out):
    steps = ns["steps"]
    calls = [c for m in steps for c in getattr(m, "tool_calls", [])]
    assert calls and calls[0]["name"] == "add" and calls[0]["args"] == {"a": 2, "b": 3}
    assert type(steps[-2]).__name__ == "ToolMessage" and steps[-2].text == "5"
    assert steps[-1].text.strip() and steps[-1].text in out and "tool_response>" not in steps[-1].text


def _embeddings(ns, out):
    vectors = ns["vectors"]
    assert len(vectors) == 1 and len(vectors[0]) == 384  # all-MiniLM-L6-v2's dimensions, as the comment says
    assert abs(sum(x * x for x in vectors[0]) - 1.0) < 1e-4  # its Normalize module


def _decisions(ns, out):
    r = ns["r"]
    assert 0.0 <= r.nouls["urgent"].noul <= 1.0
    assert r.choices["team"].choice in ("billing", "technical", "sales")
    assert 0.0 <= r.scores["anger"].score <= 2.0  # the expected level over the three named levels
    prompt = r.metadata["prompts"]["team"]  # the comment: the prompt the question became, the chat template's
    assert (
        prompt.startswith("<|im_start|>system") and "Answer with exactly one of: billing, technical, sales." in prompt
    )


CHECKS = {
    "decisions = ExLlamaDecisions(": _decisions,
    "model_dir = str(demo_model_dir())": _model_dir,
    "chain = PromptTemplate": _llm,
    "chat = ChatExLlama(": _chat,
    "class City(BaseModel)": _structured,
    "ExLlamaLLM.from_model_id(": _from_model_id,
    "TokenCountingHandler(": _llama_index,
    "rt = ExLlamaRuntime.shared(": _runtime,
    "thinker = ChatExLlama(": _reasoning,
    "agent = create_agent(": _agent,
    "emb = ExLlamaEmbeddings(": _embeddings,
}


def _check_for(block: str):
    found = [check for key, check in CHECKS.items() if key in block]
    assert len(found) == 1, f"example without exactly one check:\n{block}"
    return found[0]


def test_every_example_has_a_check():
    assert len(BLOCKS) >= 8
    assert sum(page == "README.md" for page, _ in BLOCKS) >= 3  # the model, LangChain, LlamaIndex (the server: shell)
    for _, block in BLOCKS:
        _check_for(block)


def test_python_blocks_run_in_order_and_do_what_they_say(demo_dir, capsys):
    namespace: dict = {}
    for i, (page, block) in enumerate(BLOCKS):
        try:
            exec(compile(block, f"{page} python block {i + 1}", "exec"), namespace)
        except Exception as e:  # pragma: no cover - the message is what matters
            raise AssertionError(f"{page} python block {i + 1} failed: {type(e).__name__}: {e}\n{block}") from e
        out = capsys.readouterr().out
        try:
            _check_for(block)(namespace, out)
        except AssertionError as e:
            pytest.fail(f"{page} python block {i + 1} does not do what it says: {e}\noutput: {out!r}")


def test_the_readme_stays_within_the_house_limit():
    size = len(README.encode())
    assert size <= 35_000, f"README.md is {size} bytes; the house asks for at most 35 KB: move detail into docs/"


def test_the_readme_fits_two_screens_above_its_table_of_contents():
    """What it does, install, the quick start, one example per door, one table of numbers with its plot: then the
    table of contents (issue 56). Two screens: 120 lines of at most 120 characters; code and tables count whole."""
    lines = README.splitlines()
    toc = lines.index("## Documentation")
    assert toc <= 120, f"{toc} lines above the table of contents: move detail into docs/"
    headings = [line for line in lines[:toc] if line.startswith("## ")]
    assert headings == ["## Quick start", "## Install", "## Three doors", "## Numbers"], headings
    assert "### LangChain" in lines and "### LlamaIndex" in lines and "### The server" in lines
    above = "\n".join(lines[:toc])
    assert above.count("](benchmarks/results/gpu_throughput.png)") == 1 and above.count("\n| --- |") == 1  # one table
    assert 'pip install -e ".[serve]"' in above  # from a clone: the package is not on PyPI
    listed = set(re.findall(r"\]\((docs/[\w-]+\.md)\)", "\n".join(lines[toc:])))
    assert listed == {str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")}  # every page, linked once


def test_the_quick_start_is_two_commands_that_exist():
    block = README[README.index("## Quick start") :].split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split("#")[0].strip() for line in block.splitlines()] == ["./dev demo", "./dev test"]
    dev = (ROOT / "dev").read_text()
    for flag in ("demo)", "test)", "--quick"):
        assert flag in dev
    assert "./dev test --quick" in README and "./dev test PATH" in README


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    prose = re.sub(r"```.*?```", "", text, flags=re.S)  # a "# comment" in a code block is no heading
    return {_anchor(m) for m in re.findall(r"^#{1,6} (.+)$", prose, re.M)}


def test_every_relative_link_leads_to_a_page_and_heading_that_exist():
    checked = 0
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not ours to check
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.name} links to {target}, which does not exist"
            if anchor:
                assert anchor in _anchors(linked.read_text()), f"{page.name} links to {target}: no such heading"
            checked += 1
    assert checked >= 15


def test_the_errors_the_pages_name_are_typed_errors():
    """Each error the README, docs/troubleshooting.md and the install and configuration pages name is typed."""
    from exllama_integrations import errors

    named = set(re.findall(r"`(\w+Error)`", README))
    for page in ("troubleshooting.md", "install.md", "configuration.md"):
        named |= set(re.findall(r"`(\w+Error)`", (ROOT / "docs" / page).read_text()))
    assert len(named) >= 15
    for name in named:
        cls = getattr(errors, name, None)
        assert isinstance(cls, type) and issubclass(cls, errors.ExLlamaIntegrationsError), name
