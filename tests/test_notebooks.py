"""Every notebook executes top to bottom on CPU with the demo model, and shows what its cells say it shows.

The notebooks are committed executed (outputs and plots visible on GitHub). Each cell that shows a result is
checked for that result (non-empty answers, the right shape, non-zero figures), both in a fresh execution
and in the committed outputs, so a reader never sees an empty answer or a zero bar.
"""

import ast
import re
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT = 600
"""Seconds a cell may run (docs/notebooks.md says it)."""
MACHINE_PATHS = re.compile(r"/(root|home|work|tmp|Users)/")


def shown(nb, marker: str) -> str:
    """What the one code cell whose source contains ``marker`` showed: its stdout and its result."""
    cells = [c for c in nb.cells if c.cell_type == "code" and marker in c.source]
    assert len(cells) == 1, f"{len(cells)} cells contain {marker!r}"
    parts = []
    for o in cells[0].get("outputs", []):
        if o.output_type == "stream" and o.get("name") == "stdout":
            parts.append(o.get("text", ""))
        elif o.output_type in ("execute_result", "display_data"):
            parts.append(o.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def has_image(nb, marker: str) -> bool:
    cell = next(c for c in nb.cells if c.cell_type == "code" and marker in c.source)
    return any("image/png" in o.get("data", {}) for o in cell.get("outputs", []))


def number(text: str, pattern: str) -> float:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in {text!r}"
    return float(m.group(1))


def _quickstart(nb) -> None:
    assert number(shown(nb, "ExLlamaRuntime.shared("), r"context (\d+)") > 0
    assert "Paris" in shown(nb, "use_chat_template=True")
    assert shown(nb, "llm.stream(").strip()
    answers = ast.literal_eval(shown(nb, "llm.batch("))
    assert len(answers) == 2 and all(a.strip() for a in answers)
    counted = shown(nb, "llm.get_num_tokens(text)")
    assert number(counted, r"^(\d+) \[") > 0 and "finish_reason" in counted
    stopped = ast.literal_eval(shown(nb, 'stop=[" Paris"]'))
    assert stopped.strip() and "Paris" not in stopped


def _chat(nb) -> None:
    first = shown(nb, "You are concise.")
    assert "Paris" in first and "'input_tokens'" in first
    assert "Ana" in shown(nb, "What is my name?")
    assert re.search(r"City\(name='Paris', country='France', is_capital=(True|False)\)", shown(nb, "class City"))
    calls = ast.literal_eval(shown(nb, "with_tools.invoke("))
    assert calls[0]["name"] == "add" and calls[0]["args"] == {"a": 2, "b": 3}
    final = ast.literal_eval(shown(nb, "result = add.invoke("))
    assert final.strip() and "tool_response>" not in final  # after the tool, an answer in words


def _llama_index(nb) -> None:
    assert number(shown(nb, "llm.metadata"), r"context_window=(\d+)") > 0
    answer = shown(nb, "SummaryIndex.from_documents(")
    assert "Paris" in answer
    assert number(answer, r"prompt tokens (\d+)") > 20 and number(answer, r"completion tokens (\d+)") > 0
    streamed = shown(nb, "llm.stream_chat(")
    assert streamed.split("\n")[0].strip() and "'prompt_tokens'" in streamed
    assert re.search(r"Country\(name='\w[^']*', capital='Paris'\)", shown(nb, "class Country"))


def _from_pipeline(nb) -> None:
    before, after = shown(nb, "hf = HuggingFacePipeline"), shown(nb, "ex = ExLlamaLLM.from_model_id")
    assert "Paris" in before and "Paris" in after
    counts = shown(nb, "native = len(")
    assert number(counts, r"own tokenizer: (\d+)") == number(counts, r"get_num_tokens: (\d+)") > 0
    speed = shown(nb, "def tps(")
    assert number(speed, r"HuggingFacePipeline: median ([\d.]+)") > 0
    assert number(speed, r"ExLlamaLLM: median ([\d.]+)") > 0
    assert has_image(nb, "def tps(")


def _serving(nb) -> None:
    assert "SmolLM2-135M-Instruct" in shown(nb, '/v1/models")')
    assert "Paris" in shown(nb, "client = OpenAI(") and "CompletionUsage" in shown(nb, "client = OpenAI(")
    assert shown(nb, "ChatOpenAI(").count("Paris") >= 2  # ChatOpenAI and OpenAILike
    remote = shown(nb, "remote_chat = ChatExLlama(")
    assert "Paris" in remote and number(remote, r"counted here: (\d+)") > 0
    assert re.search(r"name='Paris' country='France'", remote) and "'name': 'add'" in remote
    li = shown(nb, "li_remote = ")
    assert "Paris" in li and "'completion_tokens'" in li


def _reasoning(nb) -> None:
    first = shown(nb, "thinker = ChatExLlama(")
    assert re.search(r"thinking: \S", first) and "<think>" not in first
    assert number(first, r"'reasoning': (\d+)") > 0
    parts = ast.literal_eval(shown(nb, 'parts = {"thinking"'))
    assert parts["thinking"].strip() and "<think>" not in parts["thinking"] + parts["answer"]
    budget = shown(nb, "short = thinker.invoke(")
    assert 4 <= number(budget, r"'reasoning': (\d+)") <= 4 + 3  # the budget, then the end delimiter
    assert re.search(r"answer:\s+'\S", budget)  # after the budget, the model answers
    structured = shown(nb, "with_structured_output(City")
    assert re.search(r"thinking: '\S", structured) and re.search(r"City\(name='\w", structured)
    assert number(shown(nb, "li = ExLlamaLLM("), r"\((\d+) tokens\)") > 0
    agent = shown(nb, "create_agent(")
    assert "ToolMessage: 5" in agent and re.search(r"AIMessage: \S[^\[]*$", agent.strip())
    assert "('multiply', {'a': 6, 'b': 7}, '42')" in shown(nb, "FunctionAgent(")


def _images(nb) -> None:
    assert "accepts images: True | vision: loaded" in shown(nb, "ExLlamaRuntime.shared(model_dir")
    lc = shown(nb, "chat = ChatExLlama(")
    assert re.search(r"reply: '.+'", lc)  # a random-weight stand-in: any non-empty reply
    before, after = number(lc, r"counted before: (\d+)"), number(lc, r"input_tokens after: (\d+)")
    assert before == after > 16 and "image_inputs: True" in lc  # the image's 16 tokens counted
    li = shown(nb, "ImageBlock(path=path)")
    assert re.search(r"reply: '.+'", li) and number(li, r"prompt tokens: (\d+)") == before
    refused = shown(nb, "def claiming(")
    assert refused.count("MediaError in") == 3 and "truncated" in refused and "not an image" in refused


def _retrieval(nb) -> None:
    facts = shown(nb, "embedding_info()")
    assert number(facts, r": (\d+) dimensions") == 384 and "normalized True" in facts
    hits = [line.split("  ", 1) for line in shown(nb, "as_retriever(").strip().splitlines()]
    assert len(hits) == 4 and hits[0][1].startswith("Paris is the capital")  # our embedding retrieves it first
    scores = [float(s) for s, _ in hits]
    assert scores == sorted(scores, reverse=True)
    reranked = re.findall(r"relevance ([\d.]+)  (.+)", shown(nb, "rerank.postprocess_nodes("))
    relevance = [float(r) for r, _ in reranked]
    assert len(reranked) == 3 and all(0 < r < 1 for r in relevance) and relevance == sorted(relevance, reverse=True)
    assert {t for _, t in reranked} <= {t for _, t in hits}  # the reranker reorders what was retrieved
    answer = shown(nb, "node_postprocessors=[rerank]")
    assert "Paris" in answer.split("\n")[0] and answer.count("', '") == 2  # answered from the 3 reranked passages


def _decisions(nb) -> None:
    assert shown(nb, "ExLlamaDecisions(").strip() == "SmolLM2-135M-Instruct transformers"
    rows = re.findall(r"urgent ([\d.]+)  team (\w+) ([\d.]+)  anger ([\d.]+)  \| ", shown(nb, "decisions.batch("))
    assert len(rows) == 3
    teams = ("billing", "technical", "sales")
    assert all(0 <= float(u) <= 1 and t in teams and 0 <= float(a) <= 2 for u, t, _, a in rows)
    prompt = shown(nb, 'metadata["prompts"]')
    assert "Answer with exactly one of: billing, technical, sales.<|im_end|>" in prompt
    assert prompt.rstrip().endswith("<|im_start|>assistant")
    same = shown(nb, "alone = decisions.invoke(")
    assert "sum 1.000000000000" in same and same.count(": True") == 2  # alone vs in the batch, and twice
    routes = re.findall(r"route (\w+) \(chat ([\d.]+), code ([\d.]+)\)", shown(nb, "ModelRouterMiddleware("))
    assert len(routes) == 2 and all(abs(float(a) + float(b) - 1) < 2e-3 for _, a, b in routes)
    assert float(routes[1][2]) > float(routes[0][2])  # the code request leans further to the code model
    ratios = [float(r) for r in re.findall(r"ratio ([\d.]+) per round", shown(nb, "cpu_decisions.json"))]
    assert len(ratios) == 2 and all(r > 1 for r in ratios)  # the decision is the faster path


CLAIMS: dict[str, Callable] = {
    "01_quickstart": _quickstart,
    "02_chat_and_structured_output": _chat,
    "03_llamaindex": _llama_index,
    "04_from_huggingfacepipeline": _from_pipeline,
    "05_serving": _serving,
    "06_reasoning_and_agents": _reasoning,
    "07_images": _images,
    "08_retrieval": _retrieval,
    "09_decisions": _decisions,
}


def _plain(nb) -> str:
    """Everything a reader sees but stderr (warnings name the environment's own files)."""
    return "".join(
        o.get("text", "") + o.get("data", {}).get("text/plain", "")
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("name") != "stderr"
    )


def test_every_notebook_has_its_claims_checked() -> None:
    assert sorted(CLAIMS) == [p.stem for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_shows_what_it_says(path: Path, demo_dir) -> None:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    resources = {"metadata": {"path": str(path.parent)}}
    NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3", resources=resources).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert not MACHINE_PATHS.search(_plain(nb))  # outputs carry no machine's paths
    CLAIMS[path.stem](nb)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_notebooks_show_their_results(path: Path) -> None:
    """Committed executed in one run, top to bottom: a reader on GitHub sees every result, checked as above."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1))
    outputs = [o for c in code for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error" or o.get("name") == "stderr"]
    assert not MACHINE_PATHS.search(_plain(nb))
    CLAIMS[path.stem](nb)


def test_the_page_says_how_to_run_them() -> None:
    """docs/notebooks.md: every notebook listed, their kernel, what the test stack brings them, the headless run."""
    import importlib.metadata
    import importlib.util
    import json

    page = (ROOT / "docs" / "notebooks.md").read_text()
    listed = re.findall(r"^\| `(\d\d_\w+)\.ipynb` \|", page, re.M)
    assert listed == [p.stem for p in NOTEBOOKS]
    requires = importlib.metadata.requires("exllama-integrations") or []
    named = {re.split(r"[<>=\[ ;]", r)[0] for r in requires if re.search(r'extra == "(notebooks|test)"', r)}
    for dist in ("ipykernel", "nbclient", "matplotlib", "openai", "langchain-openai", "llama-index-llms-openai-like"):
        assert f"`{dist}`" in page and dist in named, dist
    stack = [r for r in requires if r.startswith("exllama-integrations[") and 'extra == "test"' in r]
    assert stack and "notebooks" in stack[0]  # the test stack holds the notebooks extra
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        assert nb["metadata"]["kernelspec"]["name"] == "python3"  # "each notebook's kernel is `python3`"
        code = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
        for module in set(re.findall(r"^\s*(?:from|import)\s+(\w+)", code, re.M)) - {"vision_models"}:
            assert importlib.util.find_spec(module) is not None, f"{path.name} imports {module}: not in the stack"
        # the demo model in all but 07_images, whose stand-in lives in tests/vision_models.py
        assert ("demo_model_dir" in code) == (path.stem != "07_images")
    assert "vision_models" in (ROOT / "notebooks" / "07_images.ipynb").read_text()
    assert (ROOT / "tests" / "vision_models.py").is_file()
    assert "`./dev test tests/test_notebooks.py`" in page and f"{CELL_TIMEOUT} s a cell" in page
