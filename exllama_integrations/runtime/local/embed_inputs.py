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

    def texts(self, request: EmbeddingRequest) -> list[Encoded]:
        """The inputs of an embedding request, each within the limit (or refused, or truncated if asked)."""
        prompt = self._prompt(request)
        out = []
        for i, item in enumerate(request.inputs):
            if isinstance(item, tuple):
                self._ids(i, item)
                self._limit(i, len(item), request.truncate)
                out.append(Encoded(item[: self.max_tokens]))
                continue
            text = prompt + item
            if self.pooling.do_lower_case:
                text = text.lower()
            enc = self.tok.encode(text)
            if len(enc.ids) > self.max_tokens:
                self._limit(i, len(enc.ids), request.truncate)
                enc = self.cut.encode(text)
            out.append(Encoded(tuple(enc.ids), tuple(enc.type_ids)))
        return out

    def pairs(self, request: RerankRequest) -> list[Encoded]:
        """Each (query, document) of a rerank request as the model reads it."""
        if self.tokens is not None:
            return [self._judged(request, i, d) for i, d in enumerate(request.documents)]
        out = []
        for i, doc in enumerate(request.documents):
            enc = self.tok.encode(request.query, doc)
            if len(enc.ids) > self.max_tokens:
                self._limit(i, len(enc.ids), request.truncate)
                enc = self.cut.encode(request.query, doc)
            out.append(Encoded(tuple(enc.ids), tuple(enc.type_ids)))
        return out

    def _render(self, request: RerankRequest, doc: str) -> list[int]:
        instruction = request.instruction or DEFAULT_RERANK_INSTRUCTION
        user = f"<Instruct>: {instruction}\n<Query>: {request.query}\n<Document>: {doc}"
        messages: list[dict[str, Any]] = [{"role": "system", "content": JUDGE}, {"role": "user", "content": user}]
        text = self.native.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
        return self.native.encode(text, add_special_tokens=False)

    def _judged(self, request: RerankRequest, i: int, doc: str) -> Encoded:
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


__all__ = ["JUDGE", "InputEncoder"]
