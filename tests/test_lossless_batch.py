"""Lossless River with several sequences (River's own loop, ``river/lossless_batch.py``).

Tiny random configs with 4-bit exit layers and τ = -2 (every draft leaves after ``min_layer``
layers), so drafts are often wrong, rows accept different numbers of drafts and the masked
"holes" in the shared cache are exercised; the tokens must still be the plain model's.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from test_lossless import _chi2_pvalue, river_copy, sampling_model
from test_river_core import tiny_config, tiny_model

GEN = dict(do_sample=False)


def left_padded(lengths=(12, 9, 5, 11), seed=1, pad=0):
    """``(input_ids, attention_mask)`` of random prompts of these lengths, left-padded to the longest."""
    torch.manual_seed(seed)
    n = max(lengths)
    ids = torch.randint(3, 256, (len(lengths), n))
    mask = torch.ones_like(ids)
    for b, length in enumerate(lengths):
        ids[b, :n - length] = pad
        mask[b, :n - length] = 0
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_greedy_batch_of_four_equals_the_plain_model(family):
    base = tiny_model(family)
    river = river_copy(base)
    ids, mask = left_padded()
    ref = base.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, **GEN)
    with river.river_mode("lossless"), warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the batch drafts
        out = river.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, **GEN)
    assert torch.equal(out, ref)
    s = river.river_stats
    assert s["mode"] == "lossless" and s["mean_exit_layer"] == 2
    ll = s["lossless"]
    assert ll["batch_size"] == 4 and 0 < ll["verify_passes"] < 30
    assert 0 < ll["accepted"] < ll["drafted"]  # rejections happen: rows advance by different amounts
    assert ll["rounds"] >= ll["verify_passes"] and ll["tokens_per_verify"] > 1.0


def test_exact_drafts_accept_everything_in_a_batch():
    base = tiny_model("qwen2")
    river = river_copy(base, backend="copy")
    ids, mask = left_padded((10, 6))
    ref = base.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, **GEN)
    with river.river_mode("lossless"):
        out = river.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, **GEN)
    assert torch.equal(out, ref)
    assert river.river_stats["lossless"]["acceptance_rate"] == 1.0


def test_exit_only_drafts_and_a_mask_inferred_from_the_pad_token():
    """``draft_path="exit"`` (every layer its exit copy) and a positional prompt without an
    attention mask (generate infers it from the pad token): still the plain model's tokens."""
    from river_hf import RiverConfig

    base = tiny_model("llama")
    river = river_copy(base, config=RiverConfig(draft_path="exit", draft_schedule="heuristic", draft_tokens=3))
    ids, _ = left_padded((8, 5, 7))
    ref = base.generate(ids, max_new_tokens=16, pad_token_id=0, **GEN)
    with river.river_mode("lossless"):
        out = river.generate(ids, max_new_tokens=16, pad_token_id=0, **GEN)
    assert torch.equal(out, ref)
    ll = river.river_stats["lossless"]
    assert ll["draft_path"] == "exit" and river.river_stats["mean_exit_layer"] == 0
    assert (ll["draft_schedule"], ll["draft_tokens"], ll["max_draft_tokens"]) == ("heuristic", 3, 15)


def test_rows_finish_at_different_times():
    """Two EOS ids, each first emitted by a different row at a different step: finished rows are
    padded like generate pads them, the others go on, and every row's tokens are the plain ones."""
    base = tiny_model("llama")
    river = river_copy(base)
    ids, mask = left_padded()
    n = ids.shape[1]
    free = base.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, **GEN)[:, n:]
    eos = []
    for b, step in ((0, 5), (2, 16)):  # a token no row emitted before that step
        eos.append(next(t for t in free[b, step:].tolist() if not (free[:, :step] == t).any() and t not in eos))
    ref = base.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos, pad_token_id=1, **GEN)
    with river.river_mode("lossless"):
        out = river.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos, pad_token_id=1,
                             **GEN)
    assert torch.equal(out, ref)
    ends = [next((i + 1 for i, t in enumerate(row[n:].tolist()) if t in eos), 30) for row in out]
    assert len(set(ends)) >= 2 and min(ends) < 30  # rows stopped at different lengths
    assert all((out[b, n + ends[b]:] == 1).all() for b in range(4))  # padded after their EOS


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3"])
def test_a_mask_with_holes_hides_those_positions(family, attn):
    """What the batched loop relies on: zeros in the middle of the 2-D attention mask, with
    position ids from its cumulative sum, give the logits of the sequence without those positions
    (the architecture's mask creation reads the padding mask per key position). Gemma3's sliding
    window (8) counts cache slots, holes included: 7 slots here stay inside it (a call that may
    outgrow it falls back, see below)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family), attn_implementation=attn).eval()
    torch.manual_seed(4)
    real = torch.randint(3, 256, (1, 5))
    holes = torch.cat([real[:, :3], torch.randint(3, 256, (1, 2)), real[:, 3:]], -1)
    mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = model(real).logits[0, -1]
        out = model(holes, attention_mask=mask, position_ids=positions).logits[0, -1]
        # and through a cache, as the loop feeds it: the holes come from an earlier pass
        cache = DynamicCache(config=model.config)
        model(holes[:, :5], attention_mask=mask[:, :5], position_ids=positions[:, :5], cache=cache, use_cache=True)
        step = model(holes[:, 5:], attention_mask=mask, position_ids=positions[:, 5:], cache=cache,
                     use_cache=True).logits[0, -1]
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(step, ref, atol=1e-5)


def test_sampling_with_two_rows_matches_the_plain_distribution():
    """Per row, the first two new tokens (t1 from the prefill, t2 the first a verify round
    decides) and the third (a chain of accepted/rejected drafts, k = 2) must follow the plain
    model's processed distributions: the joint p(t1) p(t2 | t1) over all 144 pairs and the
    marginal of t3, computed from the backbone; 700 lossless samples of a batch of 2 rows (one
    left-padded) must fit each (chi-square, p > 1e-3 each; false alarms 0.1 % per check)."""
    from river_hf import RiverConfig
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

    base = sampling_model()
    river = river_copy(base, config=RiverConfig(draft_tokens=2, max_draft_tokens=2, draft_schedule="constant"))
    # a deliberately poor exit head (the drafts' scores): q far from p, so the rejection path and the
    # residual distribution decide many tokens (with the tiny model's own exit path q is within 0.3 %
    # of p in total variation, and a wrong residual would go unnoticed)
    head = river.get_output_embeddings()
    torch.manual_seed(5)
    weight = head.backbone.weight.detach()
    head.exit_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.exit_head.weight.data = weight + 12 * weight.std() * torch.randn_like(weight)
    prompts = [[3, 5, 7, 4], [9, 2, 6]]
    ids = torch.tensor([prompts[0], [0] + prompts[1]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    temperature, top_k, vocab = 3.0, 10, base.config.vocab_size
    warp = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k)])

    def next_p(prefixes):
        with torch.no_grad():
            logits = base(prefixes).logits[:, -1].float()
        return torch.softmax(warp(prefixes, logits), -1).double()

    expected = []
    for p in prompts:
        x = torch.tensor([p])
        p1 = next_p(x)[0]
        p2 = next_p(torch.cat([x.repeat(vocab, 1), torch.arange(vocab)[:, None]], 1))
        pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))
        p3 = next_p(torch.cat([x.repeat(vocab * vocab, 1), pairs], 1)).view(vocab, vocab, vocab)
        joint = p1[:, None] * p2
        expected.append((joint.reshape(-1), (joint[..., None] * p3).sum((0, 1))))
    counts = [(torch.zeros(vocab * vocab, dtype=torch.float64), torch.zeros(vocab, dtype=torch.float64))
              for _ in prompts]
    gen = dict(max_new_tokens=4, do_sample=True, temperature=temperature, top_k=top_k, top_p=1.0)
    accepted = drafted = 0
    torch.manual_seed(1)
    with river.river_mode("lossless"):
        for _ in range(700):
            out = river.generate(input_ids=ids, attention_mask=mask, **gen)
            for b in range(2):
                t1, t2, t3 = out[b, 4:7].tolist()
                counts[b][0][t1 * vocab + t2] += 1
                counts[b][1][t3] += 1
            accepted += river.river_stats["lossless"]["accepted"]
            drafted += river.river_stats["lossless"]["drafted"]
    assert river.river_stats["lossless"]["batch_size"] == 2
    assert 0.3 < accepted / drafted < 0.95, "both acceptance and rejection must occur, often"
    for (pair_counts, t3_counts), (pair_p, t3_p) in zip(counts, expected):
        assert _chi2_pvalue(pair_counts, pair_p) > 1e-3
        assert _chi2_pvalue(t3_counts, t3_p) > 1e-3


@pytest.mark.parametrize("setting, named", [
    (dict(repetition_penalty=1.3), "RepetitionPenaltyLogitsProcessor"),
    (dict(no_repeat_ngram_size=2), "NoRepeatNGramLogitsProcessor"),
    (dict(min_new_tokens=5, eos_token_id=7), "MinNewTokensLengthLogitsProcessor"),
    (dict(return_dict_in_generate=True), "return_dict_in_generate"),
])
def test_a_history_dependent_setting_falls_back_to_the_backbone_and_warns(setting, named):
    base = tiny_model("llama")
    river = river_copy(base)
    ids, mask = left_padded((10, 7))
    ref = base.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, **setting, **GEN)
    with river.river_mode("lossless"), pytest.warns(UserWarning, match=f"cannot draft this call.*{named}"):
        out = river.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, **setting, **GEN)
    ref_ids = ref.sequences if hasattr(ref, "sequences") else ref
    out_ids = out.sequences if hasattr(out, "sequences") else out
    assert torch.equal(out_ids, ref_ids)
    assert river.river_stats["mode"] == "backbone" and "lossless" not in river.river_stats


def test_a_sliding_window_the_call_may_outgrow_falls_back():
    """Gemma3's window is 8 tokens of cache: masked draft positions would take window slots."""
    base = tiny_model("gemma3")
    river = river_copy(base)
    ids, mask = left_padded((10, 7))
    ref = base.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **GEN)
    with river.river_mode("lossless"), pytest.warns(UserWarning, match="sliding_window=8"):
        out = river.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **GEN)
    assert torch.equal(out, ref) and river.river_stats["mode"] == "backbone"


def test_smollm2_greedy_batch_equals_the_plain_model(smollm2_path):
    """The real SmolLM2-135M (River defaults: int4 exit layers, its calibrated τ): a batch of 3 chat
    prompts of different lengths, left-padded, 16 new tokens, streamed."""
    from transformers import AutoTokenizer

    from river_hf import RiverForCausalLM, plain_model

    tok = AutoTokenizer.from_pretrained(smollm2_path, padding_side="left")
    river = RiverForCausalLM.from_pretrained(smollm2_path, progress=False)
    plain = plain_model(river)
    texts = ["What is 7 times 8?", "Name three colours of the rainbow, please.", "Hi"]
    chats = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
             for t in texts]
    enc = tok(chats, return_tensors="pt", padding=True)
    ref = plain.generate(**enc, max_new_tokens=16, **GEN)
    streamer = Recorder()
    with river.river_mode("lossless"):
        out = river.generate(**enc, max_new_tokens=16, streamer=streamer, **GEN)
    assert torch.equal(out, ref)
    ll = river.river_stats["lossless"]
    assert ll["batch_size"] == 3 and ll["accepted"] > 0
    # with a streamer: still lossless, its puts (after the prompt) are the returned new tokens
    assert river.river_stats["mode"] == "lossless" and streamer.ended
    assert torch.equal(torch.cat(streamer.puts[1:], -1), out[:, enc["input_ids"].shape[1]:])


def test_a_processor_that_says_it_is_history_free_keeps_the_batch_drafting():
    """A caller's own logits processor that reads no token history (``history_free = True``, e.g.
    one that masks fixed ids, as the benchmarks' EOS suppressor does) keeps batched lossless
    drafting, and the tokens equal the plain model's with the same processor."""
    from transformers import LogitsProcessorList

    class MaskIds:
        history_free = True

        def __call__(self, input_ids, scores):
            return scores.index_fill_(1, torch.tensor([2, 5]), float("-inf"))

    base = tiny_model("llama")
    river = river_copy(base)
    ids, mask = left_padded((10, 7))
    ref = base.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12,
                        logits_processor=LogitsProcessorList([MaskIds()]), **GEN)
    with river.river_mode("lossless"):
        out = river.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12,
                             logits_processor=LogitsProcessorList([MaskIds()]), **GEN)
    assert torch.equal(out, ref)
    assert river.river_stats["mode"] == "lossless" and river.river_stats["lossless"]["batch_size"] == 2


class Recorder:
    """A ``BaseStreamer`` that keeps every put (a copy) and whether ``end`` was called."""

    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        assert not self.ended
        self.puts.append(value.clone())

    def end(self):
        self.ended = True


def _early_eos(base, ids, mask, new=30):
    """``(token, step)``: a token row 1 emits at ``step`` >= 4 of the free greedy run that no row
    emitted before (as EOS it ends row 1 there, first of all rows)."""
    n = ids.shape[1]
    free = base.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, **GEN)[:, n:]
    return next((t, j) for j, t in enumerate(free[1].tolist()) if j >= 4 and not (free[:, :j] == t).any())


def test_a_streamer_gets_rectangles_of_final_columns_and_the_batch_stays_lossless():
    """Batch 4, rows of different lengths, row 1 finishing early by EOS: the call drafts and
    verifies (mode lossless, no fallback warning), the streamer gets the prompt once, then
    ``[4, n]`` rectangles (the first new-token column alone, right after the prefill), and the
    puts concatenated are the returned new tokens, which are the plain model's (with or without
    a streamer: its puts concatenated are the same)."""
    base = tiny_model("llama")
    river = river_copy(base)
    ids, mask = left_padded()
    n = ids.shape[1]
    eos, step = _early_eos(base, ids, mask)
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos, pad_token_id=1, **GEN)
    plain = Recorder()
    ref = base.generate(**gen, streamer=plain)
    streamer = Recorder()
    with river.river_mode("lossless"), warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the batch drafts with a streamer
        out = river.generate(**gen, streamer=streamer)
    assert torch.equal(out, ref)
    s = river.river_stats
    assert s["mode"] == "lossless" and s["lossless"]["batch_size"] == 4 and s["lossless"]["accepted"] > 0
    assert streamer.ended and torch.equal(streamer.puts[0], ids)
    cols = streamer.puts[1:]
    assert all(c.dim() == 2 and c.shape[0] == 4 and c.shape[1] >= 1 for c in cols)
    assert cols[0].shape[1] == 1  # the first new token of every row, right after the prefill
    assert torch.equal(torch.cat(cols, -1), out[:, n:])
    assert torch.equal(torch.cat([p.reshape(4, -1) for p in plain.puts[1:]], -1), out[:, n:])
    assert len(cols) < out.shape[1] - n  # rounds brought several columns at once
    ends = [row[n:].tolist().index(eos) + 1 if eos in row[n:].tolist() else 30 for row in out]
    assert ends[1] == step + 1 < max(ends)  # row 1 finished early, the others went on (it was padded)


def test_token_timer_counts_every_row_of_a_batch_once():
    """river_hf.timing.TokenTimer on a batched lossless call and on the plain model's batch: its new
    tokens are every row's (B x new columns, as returned), the first column is the TTFT's."""
    from river_hf.timing import TokenTimer

    base = tiny_model("qwen2")
    river = river_copy(base)
    ids, mask = left_padded((9, 4, 7))
    n = ids.shape[1]
    for model, mode in ((base, None), (river, "lossless")):
        timer = TokenTimer()
        with (river.river_mode(mode) if mode else warnings.catch_warnings()):
            timer.reset()
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=17, streamer=timer, **GEN)
        returned = out[:, n:].numel()
        m = timer.measurement(returned_tokens=returned)
        assert m.new_tokens == returned == 3 * 17 and m.decode_tokens == returned - 3
        assert m.decode_steps == len(timer.arrivals) - 1
    assert river.river_stats["mode"] == "lossless" and m.decode_steps < 16
