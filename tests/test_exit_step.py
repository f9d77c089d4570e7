"""River's exit-mode decode step (``river.exit_step.ExitStep``): the same tokens, scores, logits, KV cache and
cache records as each step's forward through the model, bit for bit; any hook on a module it skips, a global
hook or padding outside ``sdpa`` makes the loop run the model's forward instead."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from river_hf import RiverConfig, enable_river
from river_hf.quant import river_int4
from river_hf.river.cache import GrowingLayer, RiverCache
from river_hf.river.exit_step import ExitStep

from test_decode_loop import _inputs  # the same prompts: one sequence, or a left-padded batch

NEW = 7


@pytest.fixture(scope="module")
def kernel():
    if not river_int4.works():
        pytest.skip(f"river-int4 is not available here: {river_int4.unavailable_reason()}")


def _river(model_type: str = "llama", attn: str = "sdpa"):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=256, hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=256)
    config._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.pad_token_id = 0
    river = RiverConfig(backend="river-int4", exit_head="river-int4", exit_layer_impl="fused", fuse_projections=True)
    return enable_river(model, config=river)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def river(request, kernel):
    return _river(request.param)


def _generate(river, monkeypatch, on: bool, seed=None, **gen):
    """Exit-mode ``generate`` with the step (``on``) or each step's forward through the model: the output
    (with ``cache``), and how many steps the ExitStep ran."""
    ran = []
    real = ExitStep.__call__

    def counted(self, *args):
        ran.append(1)
        return real(self, *args)

    with monkeypatch.context() as m:
        m.setattr(ExitStep, "__call__", counted)
        if not on:
            m.setattr(ExitStep, "prepare", classmethod(lambda *a: None))
        if seed is not None:
            torch.manual_seed(seed)
        with river.river_mode("exit"), torch.no_grad():
            out = river.generate(**gen, cache=RiverCache(config=river.config), return_dict_in_generate=True)
    return out, len(ran)


def _same_cache(a: RiverCache, b: RiverCache) -> bool:
    return (a.get_seq_length() == b.get_seq_length() and a.exit_layers == b.exit_layers
            and a.step_tokens == b.step_tokens and a.row_exit_layers == b.row_exit_layers
            and all(torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) for x, y in zip(a.layers, b.layers)))


@pytest.mark.parametrize("batch", [1, 3])
def test_the_steps_give_what_the_forward_gives(river, monkeypatch, batch):
    (out, ran), (ref, ran_ref) = (_generate(river, monkeypatch, on, **_inputs(batch), max_new_tokens=NEW,
                                            do_sample=False, output_scores=True, output_logits=True)
                                  for on in (True, False))
    assert ran == NEW - 1 and ran_ref == 0  # every decode step; the prefill is the forward's
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(x, y) for x, y in zip(out.scores + out.logits, ref.scores + ref.logits))
    assert _same_cache(out.cache, ref.cache)
    assert out.cache.get_seq_length() == out.sequences.shape[1] - 1
    assert isinstance(out.cache.layers[0], GrowingLayer)


def test_sampling_draws_the_same_tokens(river, monkeypatch):
    (out, ran), (ref, _) = (_generate(river, monkeypatch, on, seed=11, **_inputs(1), max_new_tokens=NEW,
                                      do_sample=True, top_k=20) for on in (True, False))
    assert ran == NEW - 1 and torch.equal(out.sequences, ref.sequences)


def test_rooms_that_run_out_are_grown(river, monkeypatch):
    """With two spare positions a room, the slots are grown (and brought up to date) several times."""
    monkeypatch.setattr(GrowingLayer, "MIN_ROOM", 2)
    (out, ran), (ref, _) = (_generate(river, monkeypatch, on, **_inputs(3), max_new_tokens=20, do_sample=False)
                            for on in (True, False))
    assert ran == 19 and torch.equal(out.sequences, ref.sequences) and _same_cache(out.cache, ref.cache)


def test_the_cache_it_leaves_goes_on(river, monkeypatch):
    """A second call on the first call's cache (the slots' views brought up to date at the end)."""
    inputs = _inputs(1)
    outs = []
    for on in (True, False):
        first, _ = _generate(river, monkeypatch, on, **inputs, max_new_tokens=4, do_sample=False)
        with monkeypatch.context() as m:
            if not on:
                m.setattr(ExitStep, "prepare", classmethod(lambda *a: None))
            with river.river_mode("exit"), torch.no_grad():
                seq = first.sequences
                outs.append(river.generate(input_ids=seq, attention_mask=torch.ones_like(seq), cache=first.cache,
                                           max_new_tokens=4, do_sample=False))
    assert torch.equal(outs[0], outs[1])


def _hook(module_of):
    def attach(river):
        calls = []
        return module_of(river).register_forward_hook(lambda *a: calls.append(1)), calls
    return attach


@pytest.mark.parametrize("where", ["model", "stack", "river layer", "exit layer"])
def test_a_hook_on_a_module_it_skips_sees_every_step(river, monkeypatch, where):
    module_of = {"model": lambda r: r, "stack": lambda r: r.model, "river layer": lambda r: r.model.layers[2],
                 "exit layer": lambda r: r.model.layers[1].exit_layer}[where]
    handle, calls = _hook(module_of)(river)
    try:
        (out, ran), (ref, _) = (_generate(river, monkeypatch, on, **_inputs(1), max_new_tokens=NEW, do_sample=False)
                                for on in (True, False))
    finally:
        handle.remove()
    assert ran == 0 and len(calls) == 2 * NEW and torch.equal(out.sequences, ref.sequences)


@pytest.mark.parametrize("where", ["norm", "head", "embedding"])
def test_the_modules_it_calls_keep_their_hooks(river, monkeypatch, where):
    module_of = {"norm": lambda r: r.model.norm, "head": lambda r: r.lm_head,
                 "embedding": lambda r: r.model.embed_tokens}[where]
    handle, calls = _hook(module_of)(river)
    try:
        out, ran = _generate(river, monkeypatch, True, **_inputs(1), max_new_tokens=NEW, do_sample=False)
    finally:
        handle.remove()
    assert ran == NEW - 1 and len(calls) == NEW


def test_a_global_hook_sees_every_module(river, monkeypatch):
    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: calls.append(1))
    try:
        _, ran = _generate(river, monkeypatch, True, **_inputs(1), max_new_tokens=3, do_sample=False)
    finally:
        handle.remove()
    assert ran == 0 and calls


def test_padding_under_eager_attention_runs_the_forward(kernel, monkeypatch):
    river = _river("llama", attn="eager")
    _, ran = _generate(river, monkeypatch, True, **_inputs(3), max_new_tokens=3, do_sample=False)
    _, ran_one = _generate(river, monkeypatch, True, **_inputs(1), max_new_tokens=3, do_sample=False)
    assert ran == 0 and ran_one == 2  # no padding: the mask is none either way


def test_an_error_in_a_step_leaves_the_slots_at_the_steps_done(river, monkeypatch):
    class Stop(StoppingCriteria):
        def __init__(self):
            self.seen = 0

        def __call__(self, input_ids, scores, **kwargs):
            self.seen += 1
            if self.seen == 4:
                raise KeyError("stop here")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    cache = RiverCache(config=river.config)
    inputs = _inputs(1)
    with river.river_mode("exit"), torch.no_grad(), pytest.raises(KeyError, match="stop here"):
        river.generate(**inputs, cache=cache, max_new_tokens=NEW, do_sample=False,
                       stopping_criteria=StoppingCriteriaList([Stop()]))
    # the prompt and the three steps that ran after the prefill's token
    assert cache.get_seq_length() == inputs["input_ids"].shape[1] + 3 == sum(cache.step_tokens)


def test_a_processor_that_takes_more_arguments_gets_transformers_error(river):
    class Needs(LogitsProcessor):
        def __call__(self, input_ids, scores, extra):
            return scores

    with river.river_mode("exit"), torch.no_grad(), pytest.raises(ValueError, match="required parameters"):
        river.generate(**_inputs(1), max_new_tokens=3, logits_processor=LogitsProcessorList([Needs()]))


def test_lossless_drafts_take_the_step_with_the_same_tokens(kernel, monkeypatch):
    """Lossless mode's exit-path drafts (one sequence: River's drafter in transformers' assisted decoding) run
    through the step: the same tokens as through the model's forward, and the backbone's own (τ > 1)."""
    from river_hf import disable_river

    river = _river("qwen2")
    settings = dict(tau=-2.0, min_layer=1, draft_path="exit", draft_tokens=3, prompt_lookup_tokens=0)
    river.river_config = dataclasses.replace(river.river_config, **settings)
    inputs = _inputs(1)
    runs = []
    for on in (True, False):
        ran = []
        real = ExitStep.__call__
        with monkeypatch.context() as m:
            m.setattr(ExitStep, "__call__", lambda self, *a: ran.append(1) or real(self, *a))
            if not on:
                m.setattr(ExitStep, "prepare", classmethod(lambda *a: None))
            with river.river_mode("lossless"), torch.no_grad():
                runs.append((river.generate(**inputs, max_new_tokens=12, do_sample=False), len(ran)))
    (seq, ran), (seq_ref, ran_ref) = runs
    assert ran > 0 and ran_ref == 0 and torch.equal(seq, seq_ref)
    plain = disable_river(river)
    with torch.no_grad():
        assert torch.equal(seq, plain.generate(**inputs, max_new_tokens=12, do_sample=False))
