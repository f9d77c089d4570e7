"""Route mode's backbone kernel (``RiverConfig.backbone_kernel``): the backbone layers River runs,
and the original LM head, read lossless mode's packed oneDNN copy; the exit layers do not; τ > 1
keeps the plain model's own kernels (token-identical)."""

from __future__ import annotations

import pytest
import torch
from test_batch_exit import MIXED_TAU, padded_batch, river
from test_river_core import tiny_model

from river_hf.quant.dense import PrepackedLinear, onednn_available
from river_hf.river.controllers import ExitRuleList, MinLayerRule, StateTransitionSimilarityRule
from river_hf.river.verify_kernel import backbone_mode

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


def test_rules_that_can_never_exit_are_told_apart():
    assert not ExitRuleList([MinLayerRule(2), StateTransitionSimilarityRule(1.5)]).may_exit()
    assert ExitRuleList([MinLayerRule(2), StateTransitionSimilarityRule(0.9)]).may_exit()
    assert not ExitRuleList([MinLayerRule(2)]).may_exit()


def _generate(model, **kwargs):
    ids, mask = padded_batch()
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                          output_scores=True, return_dict_in_generate=True, **kwargs)


def test_onednn_backbone_runs_only_backbone_linears_and_changes_only_summation_order():
    model = river("llama", tau=MIXED_TAU["llama"], backbone_kernel="torch")
    reference = _generate(model)
    assert model.river_stats["backbone_kernel"]["kernel"] == "torch"

    model.river_config.backbone_kernel = "onednn"
    seen = []
    original = PrepackedLinear.__torch_function__

    def spy(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            seen.append(args[1] if len(args) > 1 else kwargs["weight"])
        return original(self, func, types, args, kwargs)

    PrepackedLinear.__torch_function__ = spy
    try:
        out = _generate(model)
    finally:
        PrepackedLinear.__torch_function__ = original
    info = model.river_stats["backbone_kernel"]
    assert info["kernel"] == "onednn-prepacked" and info["packed_bytes"] > 0 and info["max_rows"] >= 1
    backbone = {id(p) for m in model.river_backbone_modules() for p in m.parameters()}
    assert seen and all(id(w) in backbone for w in seen)  # no exit-layer product went through the mode
    assert len(out.scores) == len(reference.scores)
    for a, b in zip(out.scores, reference.scores):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)


def test_tau_above_one_keeps_the_plain_kernels_and_tokens():
    model = river("llama", tau=2.0, backbone_kernel="onednn")
    plain = tiny_model("llama")
    ids, mask = padded_batch()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert model.river_stats["backbone_kernel"]["kernel"] == "torch"
    assert "τ > 1" in model.river_stats["backbone_kernel"]["why"]
    assert torch.equal(out, plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False))
    mode, info = backbone_mode(model, "onednn")
    assert mode is None and "τ > 1" in info["why"]


def test_auto_without_measurement_and_torch_pack_nothing():
    model = river("llama", tau=MIXED_TAU["llama"])  # library default: auto; tests run with RIVER_HF_AUTOTUNE=0
    assert model.river_config.backbone_kernel == "auto"
    mode, info = backbone_mode(model, "auto")
    assert mode is None and "RIVER_HF_AUTOTUNE=0" in info["why"]
    mode, info = backbone_mode(model, "torch")
    assert mode is None and info["why"] == "backbone_kernel='torch'"
    with pytest.raises(Exception, match="backbone_kernel must be one of"):
        river("llama", tau=0.9, backbone_kernel="fast")
