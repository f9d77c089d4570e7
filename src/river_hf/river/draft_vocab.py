"""A draft head over the frequent vocabulary (FR-Spec) for lossless drafts.

FR-Spec (Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via
Frequency-Ranked Speculative Sampling", arXiv 2502.14856, Sec. 3) observes that the LM head is a
large share of a small draft model's cost when the vocabulary is large (Qwen2.5: 151936 rows, a
quarter of the 0.5B model's weights) and that most tokens a model emits come from a small set of
frequent ids. The draft pass therefore scores only the ``n`` most frequent token ids, plus the
ids of the call's own prompt and output that the set lacks (:class:`CallVocab`, exact rows; an
addition to FR-Spec: a name from the prompt is rare in any corpus and likely in the answer); the
verify pass keeps the full head, so the output is still the backbone's (a token outside the set can never
be drafted, it is simply produced by the verify as its bonus token).

Frequencies are counted here on text that is not evaluation data: the source code and the
documentation shipped with this Python installation (the standard library's ``.py`` files and the
``.md`` / ``.rst`` / ``.txt`` files of the installed packages), up to :data:`CORPUS_BYTES`,
tokenized once per tokenizer and cached (``$RIVER_HF_CACHE/token_freq/<vocabulary hash>.json``,
written to a temporary file and renamed). The tokenizer's special tokens (EOS, the chat template's
markers) are always in the set.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path

import torch
from torch import nn

from ..errors import RiverError
from ..files import atomic_write

__all__ = ["CORPUS_BYTES", "token_counts", "frequent_token_ids", "FrequentVocabHead", "CallVocab", "draft_head_for"]

#: bytes of text counted (about 3/4 code, 1/4 prose); about 20-40 s of tokenization once per tokenizer
CORPUS_BYTES = 8_000_000
ALIGN = 128  # the draft head's rows: a multiple of this
_FILE_BYTES = 64_000  # at most this much of one file, so one huge file does not dominate


def _cache_dir() -> Path:
    root = os.environ.get("RIVER_HF_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "river_hf")
    return Path(root) / "token_freq"


def _corpus_files() -> tuple[list[Path], list[Path]]:
    """(code files, prose files) of this Python installation, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = sorted(p for p in stdlib.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts)
    prose: list[Path] = []
    for key in ("purelib", "platlib"):
        site = Path(sysconfig.get_paths()[key])
        if site.is_dir():
            prose += [p for p in site.rglob("*") if p.suffix in (".md", ".rst", ".txt") and p.is_file()]
    return code, sorted(set(prose))


def _corpus(limit: int) -> list[str]:
    code, prose = _corpus_files()
    texts: list[str] = []
    for files, budget in ((code, limit * 3 // 4), (prose, limit // 4)):
        used = 0
        for path in files:
            if used >= budget:
                break
            try:
                text = path.read_text(encoding="utf-8", errors="ignore")[:_FILE_BYTES]
            except OSError:
                continue
            if text.strip():
                texts.append(text)
                used += len(text)
    return texts


def _vocab_hash(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    h = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode())
    h.update(str(CORPUS_BYTES).encode())
    return h.hexdigest()[:20]


def token_counts(tokenizer, *, corpus_bytes: int = CORPUS_BYTES, cache: bool = True) -> torch.Tensor:
    """How often each token id occurs in the corpus of this module's docstring.

    Args:
        tokenizer: a transformers tokenizer (its ``len(tokenizer)`` ids are counted).
        corpus_bytes: characters of text to tokenize.
        cache: read and write the per-tokenizer cache file.

    Returns:
        ``int64 [len(tokenizer)]`` counts.

    Raises:
        RiverError: no corpus text was found (an installation without its standard library sources).
    """
    path = _cache_dir() / f"{_vocab_hash(tokenizer)}.json"
    size = len(tokenizer)
    if cache and path.is_file() and corpus_bytes == CORPUS_BYTES:
        try:
            data = json.loads(path.read_text())
            counts = torch.tensor(data["counts"], dtype=torch.int64)
            if counts.numel() == size:
                return counts
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged cache file is counted again and overwritten
    texts = _corpus(corpus_bytes)
    if not texts:
        raise RiverError("draft_vocab: no text to count token frequencies on (this Python has no standard "
                         "library sources); set RiverConfig.draft_vocab=0")
    counts = torch.zeros(size, dtype=torch.int64)
    for start in range(0, len(texts), 64):
        for ids in tokenizer(texts[start:start + 64], add_special_tokens=False)["input_ids"]:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=size)[:size]
    if cache and corpus_bytes == CORPUS_BYTES:
        atomic_write(path, json.dumps({"corpus_bytes": corpus_bytes, "files": len(texts), "counts": counts.tolist()}))
    return counts


def frequent_token_ids(tokenizer, n: int, vocab_size: int | None = None, counts: torch.Tensor | None = None) -> torch.Tensor:
    """The ``n`` most frequent token ids (:func:`token_counts`) plus every special token id,
    ascending, below ``vocab_size`` (the LM head's rows; default ``len(tokenizer)``).

    Returns:
        ``int64 [m]``: the top ``n`` and the special ids, topped up with the next-ranked ids to a
        multiple of :data:`ALIGN` (the packed int4 kernels need it), at most ``vocab_size``.

    Raises:
        RiverError: ``n`` < 1.
    """
    if not isinstance(n, int) or n < 1:
        raise RiverError(f"draft_vocab must be an integer >= 1 here, got {n!r}")
    counts = token_counts(tokenizer) if counts is None else counts
    vocab_size = vocab_size or len(tokenizer)
    counts = counts[:vocab_size]
    # ties (ids never seen) keep id order: the stable sort ranks lower ids first
    ranked = torch.sort(counts, descending=True, stable=True).indices
    special = [i for i in getattr(tokenizer, "all_special_ids", []) if 0 <= i < vocab_size]
    added = [int(i) for i in getattr(tokenizer, "added_tokens_decoder", {}) if 0 <= int(i) < vocab_size]
    extra = torch.tensor(special + added, dtype=torch.int64)
    ids = torch.unique(torch.cat([ranked[:n], extra]))
    # packed int4 kernels want the head's rows in multiples of 128: take the next-ranked ids up to one
    take = n
    while ids.numel() % ALIGN and ids.numel() < vocab_size:
        take += ALIGN - ids.numel() % ALIGN
        ids = torch.unique(torch.cat([ranked[:take], extra]))
    return ids


class FrequentVocabHead(nn.Module):
    """The LM head restricted to a set of token ids, for draft passes.

    Args:
        head: the model's LM head (``nn.Linear``, ``weight [vocab, hidden]``); not modified.
        ids: ``int64 [m]`` token ids to score (ascending).
        build: makes the quantized copy of an ``nn.Linear(hidden, m)`` (the exit head's kernel
            choice), or None for an exact copy of those rows.

    Called as ``hidden [batch, tokens, hidden]`` (model dtype) -> ``logits [batch, tokens, vocab]``
    (float32): the rows' logits at their ids, ``-inf`` everywhere else, so logits processors and
    argmax/sampling see a full-vocabulary distribution whose mass sits on the frequent ids.
    """

    def __init__(self, head: nn.Linear, ids: torch.Tensor, build=None):
        super().__init__()
        weight = head.weight.detach()
        sub = nn.Linear(weight.shape[1], ids.numel(), bias=head.bias is not None, dtype=weight.dtype,
                        device=weight.device)
        with torch.no_grad():
            sub.weight.copy_(weight[ids.to(weight.device)])
            if head.bias is not None:
                sub.bias.copy_(head.bias.detach()[ids.to(weight.device)])
        self.rows = build(sub) if build is not None else sub
        self.register_buffer("ids", ids.clone(), persistent=False)
        self.vocab_size = weight.shape[0]
        member = torch.zeros(self.vocab_size, dtype=torch.bool)
        member[ids] = True
        self.register_buffer("member", member, persistent=False)
        self.source = head

    def call_vocab(self) -> CallVocab:
        """A fresh :class:`CallVocab` for one ``generate`` call (its state lives with the call)."""
        return CallVocab(self)

    def forward(self, hidden_states: torch.Tensor, extra: CallVocab | None = None) -> torch.Tensor:
        part = self.rows(hidden_states).to(torch.float32)
        out = part.new_full((*part.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.ids] = part
        if extra is not None and extra.ids.numel():
            out[..., extra.ids] = (hidden_states @ extra.weight.T).to(torch.float32)
        return out


class CallVocab:
    """The tokens of one call that the frequent set lacks: the prompt's and those the call has
    emitted so far (a name from the prompt, ``palindrome``, is rare in any corpus but likely in
    the answer). Their rows are scored exactly (the LM head's own weights, ``[m, hidden]``) beside
    the quantized frequent rows; :meth:`add` is given the sequence before each draft."""

    def __init__(self, head: FrequentVocabHead):
        self.head = head
        self.seen = 0
        self.ids = torch.zeros(0, dtype=torch.long, device=head.ids.device)
        self.weight = head.source.weight.detach()[:0]

    def add(self, sequence: torch.Tensor) -> None:
        """Take the ids of ``sequence`` (``LongTensor [1, length]``) after the last call's length."""
        new = sequence[0, self.seen:]
        self.seen = sequence.shape[1]
        new = new[(new >= 0) & (new < self.head.vocab_size)]
        new = torch.unique(new[~self.head.member[new]])
        fresh = new[~torch.isin(new, self.ids)]  # (the shared frequent set is never changed)
        if fresh.numel():
            self.ids = torch.cat([self.ids, fresh])
            self.weight = torch.cat([self.weight, self.head.source.weight.detach()[fresh]])


def draft_head_for(model, n: int, tokenizer=None) -> FrequentVocabHead:
    """A :class:`FrequentVocabHead` of the ``n`` most frequent ids for the River ``model``, its rows
    quantized like its exit head (``RiverConfig.exit_head``, else ``backend``). Built once per
    model and ``n`` and kept on the model (``_river_draft_heads``); a changed LM head weight builds
    it again.

    Args:
        tokenizer: the model's tokenizer; default ``AutoTokenizer.from_pretrained(model.name_or_path)``.

    Raises:
        RiverError: no tokenizer was given and none loads from ``model.name_or_path`` (pass it:
            ``draft_head_for(model, n, tokenizer)``, or set ``draft_vocab=0``).
    """
    from ..quant.dense import WeightFingerprint
    from ..quant import get_backend

    head = model.get_output_embeddings()
    head = getattr(head, "backbone", head)
    heads = model.__dict__.setdefault("_river_draft_heads", {})
    cached = heads.get(n)
    if cached is not None and cached[1].matches(head.weight):
        return cached[0]
    if tokenizer is None:
        from transformers import AutoTokenizer

        source = getattr(model, "name_or_path", None) or getattr(model.config, "name_or_path", None)
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except Exception as e:  # noqa: BLE001 - any loader failure means: no tokenizer here
            raise RiverError(
                f"RiverConfig.draft_vocab={n} needs the model's tokenizer to count token frequencies, and none "
                f"loads from {source!r} ({type(e).__name__}); build the head with "
                "river_hf.river.draft_vocab.draft_head_for(model, n, tokenizer) once, or set draft_vocab=0") from None
    ids = frequent_token_ids(tokenizer, n, vocab_size=head.weight.shape[0])
    config = model.river_config
    choice = get_backend(config.exit_head or config.backend)
    draft = FrequentVocabHead(head, ids, build=lambda linear: choice.build_linear(linear)[0])
    heads[n] = (draft, WeightFingerprint(head.weight))
    return draft
