"""The decoder stack's exit-mode pass (``river.exit_pass.ExitPass``): a one-token pass that runs no backbone
layer skips the architecture's forward glue and computes the same numbers, token for token; every other pass
runs the architecture's own forward."""

from __future__ import annotations

import pytest
import torch

from river_hf import RiverConfig, disable_river, enable_river
from river_hf.quant import river_int4
from river_hf.river.exit_pass import ExitPass
from river_hf.river.exit_step import ExitStep

pytestmark = pytest.mark.filterwarnings("ignore:tau=-2 is negative")


@pytest.fixture(scope="module")
def kernel():
    if not river_int4.works():
        pytest.skip(f"river-int4 is not available here: {river_int4.unavailable_reason()}")


def _tiny(model_type: str, attn: str = "sdpa", **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=256, hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128, **extra)
    config._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def _river(model, **settings):
    config = RiverConfig(**{"tau": -2.0, "min_layer": 1, "backend": "river-int4", "exit_head": "river-int4",
                            "exit_layer_impl": "fused", "fuse_projections": True, "draft_tokens": 3,
                            "prompt_lookup_tokens": 0, **settings})
    return enable_river(model, config=config)


def _inputs(batch: int, seed: int = 5):
    ids = torch.randint(3, 256, (batch, 9), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[0, :4], mask[0, :4] = 0, 0  # left padding
    return {"input_ids": ids, "attention_mask": mask}


def _with_and_without(river, monkeypatch, mode: str, **gen):
    """``generate`` in ``mode`` with the stack's ExitPass and with the architecture's forward: for each, the
    sequences, the scores (None in lossless mode: a batch's loop returns none) and how many passes the
    ExitPass served."""
    stack = river.model
    served = []
    real = ExitPass._serve

    def counted(self, args, kwargs):
        out = real(self, args, kwargs)
        served.append(out is not None)
        return out

    runs = []
    for on in (True, False):
        with monkeypatch.context() as m:
            m.setattr(ExitPass, "_serve", counted)
            m.setattr(ExitStep, "prepare", classmethod(lambda *a: None))  # River's loop runs each step's forward
            if not on:
                m.delitem(stack.__dict__, "forward")
            served.clear()
            with river.river_mode(mode), torch.no_grad():
                if mode == "lossless":
                    out, scores = river.generate(**gen, do_sample=False), None
                else:
                    out = river.generate(**gen, do_sample=False, output_scores=True, return_dict_in_generate=True)
                    out, scores = out.sequences, torch.stack(out.scores)
        runs.append((out, scores, sum(served)))
    assert isinstance(stack.__dict__["forward"], ExitPass)
    return runs


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("mode,batch", [("exit", 1), ("exit", 3), ("lossless", 1), ("lossless", 3)])
def test_an_exit_mode_pass_skips_the_glue_with_the_same_numbers(kernel, monkeypatch, model_type, mode, batch):
    """Exit mode and lossless mode's exit-path drafts, one sequence and a left-padded batch (the boolean
    padding mask transformers gives ``sdpa``): the same tokens and scores bit for bit as the architecture's
    forward, and the ExitPass served every decode step of exit mode."""
    river = _river(_tiny(model_type), draft_path="exit")
    (seq, scores, served), (seq_ref, scores_ref, served_ref) = _with_and_without(
        river, monkeypatch, mode, **_inputs(batch), max_new_tokens=6)
    assert torch.equal(seq, seq_ref) and (mode == "lossless" or torch.equal(scores, scores_ref))
    assert served > 0 and served_ref == 0
    if mode == "exit":
        assert served == 5  # every decode pass; the prefill is the architecture's


def test_it_gives_the_architectures_cache_and_position_ids_on_a_bare_forward_call(kernel):
    """Called without ``position_ids`` (a bare forward call), it makes them as the architecture does, after
    the cache's length, and the cache holds the same K/V as the architecture's forward writes."""
    from river_hf.river.cache import RiverCache

    river = _river(_tiny("llama"))
    stack = river.model
    ids = _inputs(1)["input_ids"]
    outs = []
    for on in (True, False):
        saved = stack.__dict__.pop("forward")
        if on:
            stack.__dict__["forward"] = saved
        try:
            cache = RiverCache(config=river.config)
            with river.river_mode("exit"), torch.no_grad():
                river(input_ids=ids, cache=cache)
                logits = river(input_ids=ids[:, :1], cache=cache).logits
        finally:
            stack.__dict__["forward"] = saved
        outs.append((logits, [(layer.keys, layer.values) for layer in cache.layers]))
    (logits, kv), (logits_ref, kv_ref) = outs
    assert torch.equal(logits, logits_ref)
    assert all(torch.equal(k, kr) and torch.equal(v, vr) for (k, v), (kr, vr) in zip(kv, kv_ref))


@pytest.mark.parametrize("case", ["route", "hidden states", "sliding window", "eager padding", "training"])
def test_other_passes_run_the_architectures_forward(kernel, monkeypatch, case):
    """A pass that may run a backbone layer (route mode), asks for hidden states, has sliding-window layers
    (Mistral's ``sliding_window``), is padded under eager attention or runs in training mode: never served,
    with the same tokens as the architecture's forward."""
    model_type, attn, extra, batch, mode, gen = "llama", "sdpa", {}, 1, "exit", {}
    if case == "route":
        mode = "route"
    elif case == "hidden states":
        gen = {"output_hidden_states": True}
    elif case == "sliding window":
        model_type, extra = "mistral", {"sliding_window": 4}
    elif case == "eager padding":
        attn, batch = "eager", 3
    river = _river(_tiny(model_type, attn, **extra), tau=2.0 if case == "route" else -2.0)
    if case == "training":
        river.model.train()
    (seq, scores, served), (seq_ref, scores_ref, _) = _with_and_without(
        river, monkeypatch, mode, **_inputs(batch), max_new_tokens=4, **gen)
    assert served == 0
    assert torch.equal(seq, seq_ref) and torch.equal(scores, scores_ref)


def test_eager_attention_without_padding_is_served(kernel, monkeypatch):
    river = _river(_tiny("llama", "eager"))
    (seq, _, served), (seq_ref, _, _) = _with_and_without(river, monkeypatch, "exit", **_inputs(1), max_new_tokens=4)
    assert served == 3 and torch.equal(seq, seq_ref)


def test_a_hook_on_a_later_layer_sees_its_own_call(kernel, monkeypatch):
    """A hook on a later RiverLayer: the exit stack steps aside, the ExitPass calls that layer itself."""
    from river_hf.river.layer import RiverLayer

    river = _river(_tiny("llama"))
    layers = [m for m in river.modules() if isinstance(m, RiverLayer)]
    seen = []
    handle = layers[2].register_forward_hook(lambda module, args, out: seen.append(args[0].clone()))
    try:
        (seq, _, served), (seq_ref, _, _) = _with_and_without(river, monkeypatch, "exit", **_inputs(1),
                                                              max_new_tokens=4)
    finally:
        handle.remove()
    assert served == 3 and torch.equal(seq, seq_ref)
    assert len(seen) == 8 and all(torch.equal(a, b) for a, b in zip(seen[:4], seen[4:]))


def test_disable_river_gives_the_stack_its_own_forward(kernel):
    river = _river(_tiny("llama"))
    stack = river.model
    assert isinstance(stack.__dict__["forward"], ExitPass)
    disable_river(river)
    assert "forward" not in stack.__dict__


def test_a_stack_with_a_forward_of_its_own_keeps_it(kernel):
    """accelerate's hooks put a ``forward`` on the module itself; the exit pass must not hide it."""
    model = _tiny("llama")
    calls = []
    own = model.model.forward

    def hooked(*args, **kwargs):
        calls.append(1)
        return own(*args, **kwargs)

    model.model.forward = hooked
    river = _river(model)
    assert river.model.__dict__["forward"] is hooked
    with river.river_mode("exit"):
        river.generate(**_inputs(1), max_new_tokens=2, do_sample=False)
    assert len(calls) == 2
