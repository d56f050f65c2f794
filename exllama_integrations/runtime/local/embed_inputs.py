"""Inputs of embedding and rerank requests as the model reads them: prompts, pairs, the token limit, truncation.

Text is tokenized by the model's own ``tokenizer.json`` with its post-processor (the special tokens
sentence-transformers' tokenizer adds: ``[CLS] ... [SEP]``, a decoder embedding model's end token); token ids are
taken as given. A role's prompt (``input_type``) or the caller's is prefixed to the text, lower-cased with it where
the model's config says ``do_lower_case``. A cross-encoder reads ``(query, document)`` as the tokenizer's pair; a
yes/no reranker reads them inside its chat template's judging prompt. Over the limit, an input is refused
(:class:`~exllama_integrations.errors.InputTooLongError`) unless the request asks for truncation, which keeps its
first tokens (a pair cuts the longer side first, as sentence-transformers does; a yes/no prompt cuts the document).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ...backends.pooling import Encoded, ScoringTokens
from ...contract.retrieval import EmbeddingRequest, RerankRequest
from ...errors import InputTooLongError, InvalidSettingsError, UnsupportedModelError
from ...model.directory import ModelDirectory
from ...model.pooling import DEFAULT_RERANK_INSTRUCTION, PoolingConfig
from ...model.tokenizer import NativeTokenizer

JUDGE = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the "
    'answer can only be "yes" or "no".'
)
"""The system turn of a yes/no reranker (Qwen3-Reranker's)."""
_DOCUMENT_ROLES = ("document", "passage", "corpus", "doc")
_CHUNK_ITEMS = 64
_CHUNK_CHARS = 1 << 20
"""Texts tokenized per call (at most this many, or about this much text): each call releases the GIL, and a request
whose client went away stops within one."""


def longest_first(first: int, second: int, budget: int) -> tuple[int, int]:
    """The lengths a pair of ``first`` and ``second`` tokens is cut to within ``budget``, as tokenizers cuts them.

    Longest first: the shorter is kept whole where it fits, else each side gets half, the longer the odd token.
    """
    short, long_ = min(first, second), max(first, second)
    long_ = short if short > budget else max(short, budget - short)
    if short + long_ > budget:
        short, long_ = budget // 2, budget // 2 + budget % 2
    return (long_, short) if first > second else (short, long_)


class Abandoned(Exception):
    """The request's caller went away (its ``cancel`` event was set): the work stops between two steps."""


def check(cancel: threading.Event | None) -> None:
    """Raise :class:`Abandoned` once ``cancel`` is set."""
    if cancel is not None and cancel.is_set():
        raise Abandoned()


class InputEncoder:
    """Turns requests into :class:`Encoded` inputs for one model (see the module docstring)."""

    def __init__(self, model: ModelDirectory, pooling: PoolingConfig, native: NativeTokenizer, max_tokens: int) -> None:
        from tokenizers import Tokenizer

        if model.tokenizer_json is None:
            raise UnsupportedModelError(
                f"{model.name!r} has no tokenizer.json; embedding and rerank models are read with it."
            )
        self.name = model.name
        self.pooling = pooling
        self.native = native
        self.max_tokens = max_tokens
        self.tok = Tokenizer.from_file(str(model.tokenizer_json))
        self.tok.no_truncation()
        self.tok.no_padding()
        self.cut = Tokenizer.from_str(self.tok.to_str())
        self.cut.enable_truncation(max_tokens, strategy="longest_first")
        self.tokens = self._yes_no() if pooling.scoring == "yes_no" else None
        vocab = model.text_config.get("vocab_size")
        self.vocab = vocab if isinstance(vocab, int) and vocab > 0 else self.tok.get_vocab_size(with_added_tokens=True)
        """Token ids a client may send: below the model's vocabulary (its embedding rows)."""

    def _yes_no(self) -> ScoringTokens:
        ids = []
        for word in ("yes", "no"):
            tid = self.tok.token_to_id(word)
            if tid is None:
                enc = self.tok.encode(word, add_special_tokens=False).ids
                if len(enc) != 1:
                    raise UnsupportedModelError(f"{self.name!r} has no single token for {word!r}; it cannot rerank.")
                tid = enc[0]
            ids.append(tid)
        return ScoringTokens(yes=ids[0], no=ids[1])

    def _prompt(self, request: EmbeddingRequest) -> str:
        if request.prompt is not None:
            return request.prompt
        prompts = self.pooling.prompts
        if request.input_type == "query":
            return prompts.get("query", "")
        if request.input_type == "document":
            return next((prompts[r] for r in _DOCUMENT_ROLES if r in prompts), "")
        return ""

    def _ids(self, i: int, ids: tuple[int, ...]) -> None:
        top = max(ids)
        if top >= self.vocab:
            raise InvalidSettingsError(
                f"input[{i}] holds token id {top}, but {self.name!r} has {self.vocab} tokens (ids 0 to "
                f"{self.vocab - 1}): send text, or ids from this model's own tokenizer. LangChain's OpenAIEmbeddings "
                "sends tiktoken's ids by default: make it send text with "
                "OpenAIEmbeddings(..., check_embedding_ctx_length=False).",
                param="input",
                reason="token_id_out_of_range",
            )

    def _limit(self, i: int, n: int, truncate: bool) -> None:
        if n > self.max_tokens and not truncate:
            raise InputTooLongError(i, n, self.max_tokens, repr(self.name))

    def _encoded(self, texts: Sequence[str], cancel: threading.Event | None) -> list[Any]:
        """``texts`` tokenized without special tokens, ``cancel`` checked before each chunk.

        A chunk per call to ``encode_batch``, which releases the GIL (as the chat tokenizer does for long text).
        """
        batch = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)  # no offsets: less memory, faster
        out: list[Any] = []
        start = 0
        while start < len(texts):
            end, size = start, 0
            while end < len(texts) and end - start < _CHUNK_ITEMS and (size < _CHUNK_CHARS or end == start):
                size += len(texts[end])
                end += 1
            check(cancel)
            out += batch(list(texts[start:end]), add_special_tokens=False)
            start = end
        return out

    def texts(self, request: EmbeddingRequest, cancel: threading.Event | None = None) -> list[Encoded]:
        """The inputs of an embedding request, each within the limit (or refused, or truncated if asked)."""
        prompt = self._prompt(request)
        lower = self.pooling.do_lower_case
        texts = [prompt + item for item in request.inputs if isinstance(item, str)]
        texts = [t.lower() for t in texts] if lower else texts
        encoded = iter(self._encoded(texts, cancel))
        out = []
        for i, item in enumerate(request.inputs):
            if isinstance(item, tuple):
                self._ids(i, item)
                self._limit(i, len(item), request.truncate)
                out.append(Encoded(item[: self.max_tokens]))
                continue
            raw = next(encoded)
            enc = self.tok.post_process(raw)
            if len(enc.ids) > self.max_tokens:
                self._limit(i, len(enc.ids), request.truncate)
                enc = self.cut.post_process(raw)
            out.append(Encoded(tuple(enc.ids), tuple(enc.type_ids)))
        return out

    def pairs(self, request: RerankRequest, cancel: threading.Event | None = None) -> list[Encoded]:
        """Each (query, document) of a rerank request as the model reads it.

        The query is tokenized once, the documents in chunks that release the GIL; each pair is then the
        tokenizer's post-processing of the two (its special tokens, type ids, and the longest-first cut where asked).
        """
        if self.tokens is not None:
            out = []
            for i, d in enumerate(request.documents):
                check(cancel)
                out.append(self._judged(request, i, d))
            return out
        from tokenizers import Encoding

        query = self._encoded([request.query], cancel)[0]
        docs = self._encoded(request.documents, cancel)
        if request.max_tokens_per_doc is not None:
            for doc in docs:
                if len(doc.ids) > request.max_tokens_per_doc:
                    doc.truncate(request.max_tokens_per_doc)
        specials = self.tok.num_special_tokens_to_add(True)
        budget = self.max_tokens - specials
        whole = len(query.ids)
        if whole > budget:
            query.truncate(budget)  # no pair keeps more of it: each copy below is bounded by the model's limit
        out = []
        for i, doc in enumerate(docs):
            n = whole + len(doc.ids) + specials
            if n > self.max_tokens:
                self._limit(i, n, request.truncate)
                keep_query, keep_doc = longest_first(whole, len(doc.ids), budget)
                cut = Encoding.merge([query], growing_offsets=False)  # a copy
                cut.truncate(keep_query)
                doc.truncate(keep_doc)
                enc = self.tok.post_process(cut, doc)
            else:
                enc = self.tok.post_process(query, doc)
            out.append(Encoded(tuple(enc.ids), tuple(enc.type_ids)))
        return out

    def _render(self, request: RerankRequest, doc: str) -> list[int]:
        instruction = request.instruction or DEFAULT_RERANK_INSTRUCTION
        user = f"<Instruct>: {instruction}\n<Query>: {request.query}\n<Document>: {doc}"
        messages: list[dict[str, Any]] = [{"role": "system", "content": JUDGE}, {"role": "user", "content": user}]
        text = self.native.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
        return self.native.encode(text, add_special_tokens=False)

    def _judged(self, request: RerankRequest, i: int, doc: str) -> Encoded:
        most = request.max_tokens_per_doc
        if most is not None:
            doc_ids = self.native.encode(doc, add_special_tokens=False)
            doc = self.native.decode(doc_ids[:most]) if len(doc_ids) > most else doc
        ids = self._render(request, doc)
        if len(ids) <= self.max_tokens:
            return Encoded(tuple(ids))
        self._limit(i, len(ids), request.truncate)
        doc_ids = self.native.encode(doc, add_special_tokens=False)
        for _ in range(4):  # decoding a cut document and encoding it again may differ by a token or two
            keep = len(doc_ids) - (len(ids) - self.max_tokens)
            if keep <= 0:
                raise InputTooLongError(i, len(ids), self.max_tokens, repr(self.name))
            doc_ids = doc_ids[:keep]
            ids = self._render(request, self.native.decode(doc_ids))
            if len(ids) <= self.max_tokens:
                return Encoded(tuple(ids))
        raise InputTooLongError(i, len(ids), self.max_tokens, repr(self.name))


__all__ = ["JUDGE", "Abandoned", "InputEncoder", "check"]
