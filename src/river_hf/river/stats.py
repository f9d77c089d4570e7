"""``river_stats``: the statistics of one ``generate`` call, from its pass log.

:func:`summarize` is the body of :meth:`~river_hf.river.modeling.RiverForCausalLM.river_summary`
as a function of what it reads: the router's pass log (``(batch, tokens, exit_layer, end_time)``
per forward pass), the model's weight bytes per decode step (``_river_step_bytes``, built by
:mod:`.build`) and, for a lossless call, the drafter's record. :func:`kernel_groups` is
``river_kernels()``: the build's kernel report grouped by shape and kernel.
"""

from __future__ import annotations

from .layer import EXIT_ONLY, LOSSLESS
from .drafter import ExitPathDrafter

__all__ = ["summarize", "kernel_groups"]


def summarize(log: list | None, *, num_layers: int, mode: str, strategy: str, step_bytes: dict[str, list[int]],
              seconds: float | None = None, start: float | None = None, new_tokens: int | None = None,
              lossless: dict | None = None) -> dict:
    """Statistics of one ``generate`` call from its pass log (:meth:`RiverRouter.recording`).

    Args:
        log: the call's ``(batch, tokens, exit_layer, end_time[, row_exit_layers])`` per forward
            pass (``row_exit_layers``: each row's exit layer; absent: every row at ``exit_layer``).
        num_layers: L, the model's decoder layers.
        mode: the router's mode in force (``route``, ``backbone``, ``exit``, ``lossless``).
        strategy: the name of the exit strategy in force (route mode).
        step_bytes: ``{strategy: [weight bytes of a decode step whose exit layer is k, k = 0..L]}``.
        seconds: wall time of the call (s).
        start: ``time.perf_counter()`` at the call's start.
        new_tokens: tokens the call generated (batch x new positions of the output); None:
            one per row and forward pass (true for plain decoding, not for drafting).
        lossless: the lossless drafter's record (:meth:`ExitPathDrafter.stats`), or None.

    Returns a dict with:
        num_layers: L.
        mode: ``"lossless"`` when the call drafted and verified, else ``"route"`` (River, or
            the mode in force: ``backbone`` / ``exit`` calls run every pass that way).
        prefill_exit_layer: exit layer of the first pass (prefill).
        forward_passes: passes after the prefill (decode steps; in lossless mode drafts + verifies).
        decode_steps: passes that could exit: every pass after the prefill, or in lossless
            mode the draft passes.
        decode_rows: the (row, pass) pairs of those passes (= decode_steps at batch 1); in a
            batch each row exits at its own layer, so the next three count rows, not passes.
        mean_exit_layer: mean exit layer over those rows of those passes (= backbone layers
            run; L: no exit).
        exit_fraction: fraction of them that left the backbone early.
        exit_layer_counts: list of L+1 counts; entry k = rows of passes whose exit layer is k.
        new_tokens: generated tokens (all rows).
        seconds, tokens_per_s: wall time of the call (s) and new tokens per second over it.
        prefill_seconds: from the call's start to the end of the first forward pass (TTFT, s).
        decode_seconds, decode_tokens_per_s: time after the prefill (s; to the end of the last
            pass, in lossless mode of the last round) and the tokens generated in it per second
            (new tokens minus the prefill's one per row).
        weight_bytes_per_token: weight bytes the passes after the prefill read, per token
            generated after the prefill (a pass reads each weight it uses once, whatever its
            token count or rows; a pass whose rows exited at different layers reads the backbone
            to its deepest row's exit and the exit path from its shallowest's).
        bandwidth_gb_s: those bytes / decode_seconds / 1e9 (GB/s).
        lossless: (lossless calls) acceptance rate, mean accepted draft length, drafts per
            verify, tokens per verify, draft and verify seconds (:meth:`ExitPathDrafter.stats`),
            plus ``overhead_seconds`` = decode_seconds - draft - verify. A batched call
            (:mod:`.lossless_batch`) adds ``batch_size`` and ``verify_passes`` (batch passes); its
            ``rounds``, ``drafted``, ``accepted`` (and so the rates and ``tokens_per_verify``) are
            summed over rows, one round per live row per verify pass.
    """
    log = log or []
    L = num_layers
    after = log[1:]
    if lossless is not None:
        exits = list(lossless.get("draft_exit_layers", []))
    else:
        exits = [e for entry in after for e in _row_exits(entry)]
    counts = [0] * (L + 1)
    for e in exits:
        counts[e] += 1
    batch = log[0][0] if log else 0
    if new_tokens is None:
        new_tokens = batch * len(log)
    stats = {
        "num_layers": L,
        "mode": LOSSLESS if lossless is not None else mode,
        "prefill_exit_layer": log[0][2] if log else None,
        "forward_passes": len(after),
        "decode_steps": len(exits) if lossless is not None else len(after),
        "decode_rows": len(exits),
        "mean_exit_layer": (sum(exits) / len(exits)) if exits else None,
        "exit_fraction": (sum(e < L for e in exits) / len(exits)) if exits else None,
        "exit_layer_counts": counts,
        "new_tokens": new_tokens,
    }
    decode_tokens = new_tokens - batch
    # lossless drafts and exit mode run River's exit layers whatever strategy is set for route mode
    runs_exit_layers = lossless is not None or mode == EXIT_ONLY
    bytes_of = step_bytes["river" if runs_exit_layers else strategy]
    skip_bytes = step_bytes.get("skipdecode")
    pass_bytes = sum(_pass_bytes(bytes_of, skip_bytes, _row_exits(entry)) for entry in after)
    if after and decode_tokens > 0:
        stats["weight_bytes_per_token"] = pass_bytes / decode_tokens
    if seconds is not None:
        stats["seconds"] = seconds
        stats["tokens_per_s"] = new_tokens / seconds if seconds > 0 else None
        if log and start is not None:
            stats["prefill_seconds"] = log[0][3] - start
        if after:
            end = lossless.get("last_round_end", log[-1][3]) if lossless is not None else log[-1][3]
            decode_seconds = end - log[0][3]
            stats["decode_seconds"] = decode_seconds
            if decode_seconds > 0:
                stats["decode_tokens_per_s"] = decode_tokens / decode_seconds
                stats["bandwidth_gb_s"] = pass_bytes / decode_seconds / 1e9
    if lossless is not None:
        stats["lossless"] = ExitPathDrafter.stats(lossless)
        if "batch_size" in lossless:  # a batched call: rounds/drafted/accepted count rows, costs a whole pass
            s, passes, step = stats["lossless"], lossless.get("verify_passes", 0), lossless.get("backbone_step_seconds")
            s["batch_size"], s["verify_passes"] = lossless["batch_size"], passes
            s["verify_cost_steps"] = s["by_source"]["exit_path"]["verify_cost_steps"] = (
                lossless.get("verify_seconds", 0.0) / passes / step if passes and step else None)
        if "decode_seconds" in stats:
            s = stats["lossless"]
            s["overhead_seconds"] = stats["decode_seconds"] - s["draft_seconds"] - s["verify_seconds"]
    return stats


def _row_exits(entry: tuple) -> tuple[int, ...]:
    """Each row's exit layer of one pass-log entry."""
    return entry[4] if len(entry) > 4 else (entry[2],) * entry[0]


def _pass_bytes(bytes_of: list[int], skip_bytes: list[int] | None, row_exits) -> int:
    """Weight bytes of one pass whose rows exited at ``row_exits``: ``bytes_of[k]`` when they all
    exited at k. Rows at lo < hi read the union: backbone layers 0..hi-1, the strategy's layers
    from lo on, the exit head, and the original head when a row stayed (hi = L). ``skip_bytes``
    (the ``skipdecode`` list: backbone to k, then the head alone) separates the backbone from
    the strategy's part: union = bytes_of[lo] + skip[hi] - skip[lo] (+ skip[0], the exit head,
    when hi = L, whose entry counts the original head instead)."""
    lo, hi = min(row_exits), max(row_exits)
    if lo == hi or skip_bytes is None:
        return bytes_of[hi]
    L = len(bytes_of) - 1
    return bytes_of[lo] + skip_bytes[hi] - skip_bytes[lo] + (skip_bytes[0] if hi == L else 0)


def kernel_groups(report: list[dict]) -> list[dict]:
    """The build's kernel report (one row per exit Linear) grouped per (where, shape, kernel); see
    :meth:`~river_hf.river.modeling.RiverForCausalLM.river_kernels`."""
    groups: dict[tuple, dict] = {}
    for row in report:
        where = "exit head" if row["name"].startswith("lm_head") else "exit layers"
        key = (where, row["in_features"], row["out_features"], row["kernel"], row.get("prompt_kernel"))
        g = groups.setdefault(key, {"where": where, "shape": f"{row['in_features']}x{row['out_features']}",
                                    "kernel": row["kernel"], "count": 0, "names": [], "errors": [], "prompt_errors": []})
        g["count"] += 1
        g["errors"].append(row["relative_error"])
        if len(g["names"]) < 3:
            g["names"].append(row["name"])
        if "us_per_call" in row:
            g["us_per_call"] = row["us_per_call"]
        if row.get("prompt_kernel"):  # calls of PROMPT_MIN_ROWS+ rows run on it (RiverConfig.prompt_kernel)
            g["prompt_kernel"] = row["prompt_kernel"]
            g["prompt_errors"].append(row["prompt_relative_error"])
            if "prompt_us_per_call" in row:
                g["prompt_us_per_call_128_rows"] = row["prompt_us_per_call"]
    out = []
    for g in groups.values():
        errors, prompt_errors = g.pop("errors"), g.pop("prompt_errors")
        g["relative_error"] = sum(errors) / len(errors)
        if prompt_errors:
            g["prompt_relative_error"] = sum(prompt_errors) / len(prompt_errors)
        out.append(g)
    return out
