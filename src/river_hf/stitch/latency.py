"""Latency estimator for R-Stitch trajectories.

Source: R-Stitch (arXiv 2507.17307), Sec. 3 (latency estimation): the cost of a forward pass of
each model is modelled as a linear function of the number of tokens it processes and the length
of the KV cache it attends to, fitted from measured samples; a trajectory's cost is the sum over
its forwards.

Here, per model and per phase (``decode``: one token; ``prefill``: more than one token, which
includes R-Stitch's catch-up forwards):

    seconds = a + b * tokens + c * cache_length

fitted by least squares (``numpy.linalg.lstsq``) on samples from :meth:`LatencyEstimator.calibrate`
(a short run on random token ids) or from any ``StitchStats.forward_log``. For the decode phase
``tokens`` is always 1, so ``b`` is 0 and ``a`` absorbs it.
"""

from __future__ import annotations

import json
import os
import time
from typing import Iterable

import numpy as np
import torch

from ..errors import RiverError

__all__ = ["LatencyEstimator"]

PHASES = ("prefill", "decode")


def _phase(tokens: int) -> str:
    return "decode" if tokens == 1 else "prefill"


class LatencyEstimator:
    """Per-model linear latency model ``seconds = a + b*tokens + c*cache_length``.

    Attributes:
        coef: ``{model_name: {"prefill"|"decode": [a, b, c]}}``, seconds, seconds/token,
            seconds/cached token.
        meta: free-form information saved with the fit (device, dtype, sample counts).
    """

    def __init__(self, coef: dict | None = None, meta: dict | None = None):
        self.coef = coef or {}
        self.meta = meta or {}

    # ------------------------------------------------------------------ fitting
    @classmethod
    def fit(cls, samples: Iterable[tuple[str, int, int, float]], meta: dict | None = None) -> "LatencyEstimator":
        """Fit from ``(model_name, tokens_processed, cache_length, seconds)`` samples.

        Raises:
            RiverError: a model/phase has fewer than 2 samples.
        """
        groups: dict[tuple[str, str], list] = {}
        for name, n, L, s in samples:
            groups.setdefault((name, _phase(int(n))), []).append((int(n), int(L), float(s)))
        coef: dict = {}
        counts: dict = {}
        for (name, phase), rows in groups.items():
            arr = np.asarray(rows, dtype=np.float64)
            if len(arr) < 2:
                raise RiverError(f"latency estimator: only {len(arr)} {phase} sample(s) for {name}; calibrate longer")
            if phase == "decode":
                X = np.stack([np.ones(len(arr)), arr[:, 1]], axis=1)
                (a, c), *_ = np.linalg.lstsq(X, arr[:, 2], rcond=None)
                coef.setdefault(name, {})[phase] = [float(a), 0.0, float(c)]
            else:
                X = np.stack([np.ones(len(arr)), arr[:, 0], arr[:, 1]], axis=1)
                sol, *_ = np.linalg.lstsq(X, arr[:, 2], rcond=None)
                coef.setdefault(name, {})[phase] = [float(v) for v in sol]
            counts[f"{name}/{phase}"] = len(arr)
        m = dict(meta or {})
        m["samples"] = counts
        return cls(coef, m)

    @classmethod
    @torch.no_grad()
    def calibrate(
        cls,
        models: dict,
        *,
        cache_lengths: tuple[int, ...] = (32, 160, 320, 512),
        chunk_sizes: tuple[int, ...] = (1, 1, 1, 8, 32, 96),
        seed: int = 0,
        progress: bool = True,
    ) -> "LatencyEstimator":
        """Measure forwards of each model on random token ids and fit.

        For every cache length L: one prefill of L tokens from an empty cache, then for every chunk
        size n a forward of n tokens on top of the L cached ones (the cache is cropped back to L in
        between with ``DynamicCache.crop``). That gives decode samples (n = 1) and prefill samples at several (n, L).

        Args:
            models: ``{name: model}``, e.g. ``{"slm": slm, "llm": llm}``.
            cache_lengths / chunk_sizes: the grid, tokens.
        """
        from tqdm.auto import tqdm
        from transformers import DynamicCache

        gen = torch.Generator().manual_seed(seed)
        samples = []
        total = len(models) * len(cache_lengths) * (1 + len(chunk_sizes))
        bar = tqdm(total=total, desc="latency calibration", disable=not progress)
        for name, model in models.items():
            vocab = model.config.get_text_config().vocab_size
            device = model.device
            ids = torch.randint(min(100, vocab // 2), min(vocab, 30000), (1, max(cache_lengths) + max(chunk_sizes)), generator=gen)
            ids = ids.to(device)
            model(input_ids=ids[:, :8])  # warm-up, not recorded
            for L in cache_lengths:
                cache = DynamicCache(config=model.config)
                t0 = time.perf_counter()
                model(input_ids=ids[:, :L], cache=cache, use_cache=True, logits_to_keep=1)
                samples.append((name, L, 0, time.perf_counter() - t0))
                bar.update(1)
                for n in chunk_sizes:
                    t0 = time.perf_counter()
                    model(input_ids=ids[:, L : L + n], cache=cache, use_cache=True, logits_to_keep=1)
                    samples.append((name, n, L, time.perf_counter() - t0))
                    cache.crop(-(cache.get_seq_length() - L))  # transformers 5: negative = tokens to drop
                    bar.update(1)
        bar.close()
        meta = {
            "device": str(next(iter(models.values())).device),
            "dtypes": {k: str(m.dtype) for k, m in models.items()},
            "torch_threads": torch.get_num_threads(),
            "raw_samples": samples,
        }
        return cls.fit(samples, meta)

    # ------------------------------------------------------------------ prediction
    def predict_forward(self, name: str, tokens: int, cache_length: int) -> float:
        """Predicted seconds of one forward of ``tokens`` tokens over ``cache_length`` cached ones."""
        if name not in self.coef:
            raise RiverError(f"latency estimator has no fit for model {name!r} (has: {', '.join(self.coef)})")
        a, b, c = self.coef[name][_phase(int(tokens))]
        return max(0.0, a + b * tokens + c * cache_length)

    def predict_log(self, forward_log: Iterable[tuple[str, int, int, float]]) -> float:
        """Predicted seconds of a whole trajectory given as ``StitchStats.forward_log``."""
        return sum(self.predict_forward(name, n, L) for name, n, L, *_ in forward_log)

    def predict_autoregressive(self, name: str, prompt_len: int, new_tokens: int) -> float:
        """Predicted seconds of plain decoding with one model: one prefill of the prompt, then
        ``new_tokens - 1`` one-token forwards (the last token needs no forward)."""
        if new_tokens <= 0:
            return 0.0
        total = self.predict_forward(name, prompt_len, 0)
        for i in range(new_tokens - 1):
            total += self.predict_forward(name, 1, prompt_len + i)
        return total

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict:
        return {"formula": "seconds = a + b*tokens + c*cache_length", "coef": self.coef, "meta": self.meta}

    def save(self, path: str | os.PathLike) -> None:
        """Write JSON atomically (temp file, then ``os.replace``; :func:`river_hf.files.atomic_write`)."""
        from ..files import atomic_write

        atomic_write(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "LatencyEstimator":
        """Read a file written by :meth:`save`. Raises RiverError if it is missing or malformed."""
        try:
            with open(path) as f:
                d = json.load(f)
            coef = d["coef"]
            for name, phases in coef.items():
                for ph in phases:
                    if ph not in PHASES or len(phases[ph]) != 3:
                        raise KeyError(ph)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise RiverError(f"cannot read latency estimator {path}: {e}; re-run the calibration") from e
        return cls(coef, d.get("meta", {}))
