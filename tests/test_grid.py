"""river-grid (``quant/grid.py``, ``RiverConfig.backbone_grid``): each GGUF block format parsed into
the grid gguf-py's own dequantization computes, bit for bit; the product equal to ``F.linear`` up to
fp32 summation order; only weights that match their grid exactly are read from it; River's route mode
and lossless verify read the grid, τ > 1 never does, and lossless stays token-identical."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from river_hf.errors import RiverError
from river_hf.quant import river_int4

pytestmark = pytest.mark.skipif(not river_int4.works(), reason="river-hf's C++ kernels cannot run here")


def _random_blocks(fmt: str, n_blocks: int, seed: int = 0) -> np.ndarray:
    """Random bytes in ``fmt``'s block layout, with every fp16 field a finite scale."""
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    halves = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2],
              "Q5_K": [0, 2], "Q6_K": [type_size - 2]}[fmt]
    for at in halves:
        blocks[:, at:at + 2] = rng.uniform(-0.05, 0.05, size=n_blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_each_format_gives_gguf_pys_own_dequantized_weights_bit_for_bit(fmt):
    import gguf

    from river_hf.quant.grid import GRID_FORMATS, GridWeight

    out_features, in_features = 12, 512  # 12 rows: the last block of 4 rows full; 512 = 2 K-quant blocks a row
    block_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt]][0]
    blocks = _random_blocks(fmt, out_features * in_features // block_size)
    expected = gguf.quants.dequantize(blocks.reshape(-1), gguf.GGMLQuantizationType[fmt]).reshape(out_features, in_features)
    q, scale, offset, group = GRID_FORMATS[fmt](blocks)
    grid = GridWeight(torch.from_numpy(np.ascontiguousarray(q.reshape(out_features, in_features))),
                      torch.from_numpy(np.ascontiguousarray(scale.reshape(out_features, -1))),
                      None if offset is None else torch.from_numpy(np.ascontiguousarray(offset.reshape(out_features, -1))))
    assert grid.group == group
    assert torch.equal(grid.dequantize(), torch.from_numpy(np.ascontiguousarray(expected)))
    assert grid.nbytes < out_features * in_features * 4 / 2.5  # int8 values + fp32 group scales


@pytest.mark.parametrize("rows", [1, 3, 4, 16])
def test_the_product_is_f_linear_on_the_same_weights_up_to_summation_order(rows):
    from river_hf.quant.grid import GridWeight

    gen = torch.Generator().manual_seed(rows)
    out_features, in_features, group = 10, 256, 32  # 10 rows: a padded last block
    q = torch.randint(-32, 32, (out_features, in_features), dtype=torch.int8, generator=gen)
    scale = torch.rand(out_features, in_features // group, generator=gen) * 0.01
    offset = torch.rand(out_features, in_features // group, generator=gen) * 0.01
    grid = GridWeight(q, scale, offset)
    weight = grid.dequantize()
    reference = (scale.double().repeat_interleave(group, 1) * q.double() + offset.double().repeat_interleave(group, 1)).float()
    assert torch.equal(weight, reference)
    x, bias = torch.randn(2, rows, in_features, generator=gen), torch.randn(out_features, generator=gen)
    y = grid.mm(x, bias)
    expected = F.linear(x, weight, bias)
    assert y.shape == expected.shape and y.dtype == torch.float32
    assert float((y - expected).norm() / expected.norm()) < 1e-5


@pytest.mark.parametrize("group", [16, 32, 512])
def test_a_row_gets_the_same_numbers_whatever_the_calls_other_rows(group):
    """Past a few rows the kernel dequantizes each block once into a tile and runs every row from it;
    each row's output still equals its one-row call bit for bit (same fma, same summation order):
    rows 1..13 with and without offsets, an input width that leaves a part-chunk of the 256-channel tile
    (group 16 / 32) or a group wider than the tile (512)."""
    from river_hf.quant.grid import GridWeight

    gen = torch.Generator().manual_seed(group)
    out_features, in_features = 7, 1536 if group == 512 else 352
    q = torch.randint(-32, 32, (out_features, in_features), dtype=torch.int8, generator=gen)
    scale = torch.rand(out_features, in_features // group, generator=gen) * 0.01
    for offset in (None, torch.rand(out_features, in_features // group, generator=gen) * 0.01):
        grid = GridWeight(q, scale, offset)
        bias = torch.randn(out_features, generator=gen)
        for rows in range(1, 14):
            x = torch.randn(rows, in_features, generator=gen)
            alone = torch.cat([grid.mm(x[r:r + 1], bias) for r in range(rows)])
            assert torch.equal(grid.mm(x, bias), alone), rows
        assert grid.mm(torch.randn(0, in_features), bias).shape == (0, out_features)  # no rows: no passes


def test_a_bad_group_size_is_refused():
    from river_hf.quant.grid import GridWeight

    with pytest.raises(RuntimeError, match="multiple of"):
        GridWeight(torch.zeros(4, 24, dtype=torch.int8), torch.ones(4, 3), None)  # groups of 8 < one vector


@pytest.fixture(scope="module")
def smollm2_gguf(smollm2_path):
    from river_hf.models import gguf_file

    return gguf_file("smollm2-135m", progress=False)


def test_every_weight_of_the_real_model_is_on_its_gguf_grid_and_a_changed_one_is_not(smollm2, smollm2_gguf):
    from river_hf.quant.grid import grid_weights

    model, _ = smollm2
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    some = dict(list(linears.items())[:8])  # q/k (Llama's permuted rows), v, o, gate, up, down of layer 0, layer 1's q
    grids, info = grid_weights(model, smollm2_gguf, some)
    assert info["kept"] == len(some) and not info["skipped"]
    for m, grid in grids.items():
        assert torch.equal(grid.dequantize(), m.weight)

    changed = torch.nn.Linear(576, 576, bias=False)  # layer 0's q_proj shape, other values
    with torch.no_grad():
        changed.weight.copy_(linears["model.layers.0.self_attn.q_proj"].weight)
        changed.weight[3, 7] += 1e-3
    grids, info = grid_weights(model, smollm2_gguf, {"model.layers.0.self_attn.q_proj": changed,
                                                     "model.layers.0.no_such": changed})
    assert not grids and set(info["skipped"]) == {"model.layers.0.self_attn.q_proj", "model.layers.0.no_such"}
    assert "does not give" in info["skipped"]["model.layers.0.self_attn.q_proj"]


def test_grid_linear_reroutes_only_its_weights_rows_and_drops_a_changed_weight(smollm2, smollm2_gguf):
    from river_hf.quant.grid import GridLinear, grid_weights

    model, _ = smollm2
    name = "model.layers.0.mlp.up_proj"
    up = dict(model.named_modules())[name]
    copy = torch.nn.Linear(up.in_features, up.out_features, bias=False)
    with torch.no_grad():
        copy.weight.copy_(up.weight)
    grids, _ = grid_weights(model, smollm2_gguf, {name: copy})
    mode = GridLinear(grids, max_rows=4)
    other = torch.randn(8, up.in_features)
    with mode:
        for rows in (1, 4, 5):
            x = torch.randn(rows, up.in_features)
            y = F.linear(x, copy.weight)
            assert float((y - x @ copy.weight.T).norm() / y.norm()) < 1e-5
        F.linear(torch.randn(1, up.in_features), torch.randn(3, up.in_features))  # not its weight
        F.linear(other, copy.weight)  # 8 rows: past max_rows
    assert mode.calls_rerouted == 2 and mode.packed_bytes > 0

    with torch.no_grad():
        copy.weight[0, 0] += 1.0  # in place: the grid no longer stands for it
    mode.refresh()
    assert len(mode) == 0 and mode.dropped == 1
    with mode:
        y = F.linear(torch.ones(1, up.in_features), copy.weight)
    assert mode.calls_rerouted == 2 and torch.allclose(y, copy.weight.sum(1, keepdim=True).T, rtol=1e-5, atol=1e-4)


def test_backbone_grid_setting_is_checked(tmp_path):
    from river_hf import RiverConfig

    with pytest.raises(RiverError, match="backbone_grid"):
        RiverConfig(backbone_grid=str(tmp_path / "missing.gguf"))
    with pytest.raises(RiverError, match="no such file: '~/no-such-river-grid.gguf'"):
        RiverConfig(backbone_grid="~/no-such-river-grid.gguf")  # ~ is expanded, then looked for
    with pytest.raises(RiverError, match="backbone_grid"):
        RiverConfig(backbone_grid=3)
    text = tmp_path / "notes.txt"
    text.write_text("not a GGUF file")
    for bad, why in ((str(text), "not a GGUF file"), (str(tmp_path), "a directory"), ("", "an empty path")):
        with pytest.raises(RiverError, match=why):
            RiverConfig(backbone_grid=bad)
    assert RiverConfig(backbone_grid="off").backbone_grid == "off"


def test_river_reads_the_grid_in_route_mode_and_verify_never_at_tau_above_one(smollm2, smollm2_path, smollm2_gguf):
    from river_hf import RiverForCausalLM

    model, tok = smollm2
    ids = tok("def add(a, b):\n    return", return_tensors="pt")
    plain = model.generate(**ids, max_new_tokens=12, do_sample=False)

    river = RiverForCausalLM.from_pretrained(smollm2_path, tau=2.0, backbone_kernel="river-fp32",
                                             backbone_grid=smollm2_gguf)
    assert torch.equal(river.generate(**ids, max_new_tokens=12, do_sample=False), plain)  # τ > 1: plain kernels
    assert river.river_stats["backbone_kernel"]["kernel"] == "torch"

    river.set_river_tau(0.9)
    river.generate(**ids, max_new_tokens=12, do_sample=False)
    info = river.river_stats["backbone_kernel"]
    assert info["kernel"] == "river-grid" and info["grid"]["kept"] == 211 and info["grid"]["skipped"] == 0
    assert info["grid"]["source"] == smollm2_gguf and info["grid"]["bytes"] > 0

    lossless = RiverForCausalLM.from_pretrained(smollm2_path, lossless=True, backbone_grid=smollm2_gguf)
    lossless.river_config.verify_kernel = "river-fp32"  # unmeasured (the tests' RIVER_HF_AUTOTUNE=0 packs nothing)
    assert torch.equal(lossless.generate(**ids, max_new_tokens=12, do_sample=False), plain)
    verify = lossless.river_stats["lossless"]["verify_kernel"]
    assert verify["one_row"] == "river-grid" and verify["grid"]["max_rows"] >= 1

    off = RiverForCausalLM.from_pretrained(smollm2_path, tau=0.9, backbone_kernel="river-fp32", backbone_grid="off")
    off.generate(**ids, max_new_tokens=4, do_sample=False)
    assert off.river_stats["backbone_kernel"]["kernel"] == "river-fp32"
    assert off.river_stats["backbone_kernel"]["grid"]["why"] == "backbone_grid='off'"


def test_river_stats_count_the_grid_bytes_a_step_reads(smollm2_path, smollm2_gguf):
    from river_hf import RiverForCausalLM

    river = RiverForCausalLM.from_pretrained(smollm2_path, tau=0.9, backbone_kernel="river-fp32", backbone_grid="off")
    fp32 = {name: list(row) for name, row in river._river_step_bytes.items()}
    river.river_config.backbone_grid = smollm2_gguf
    river.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
    grid = river._river_step_bytes["river"]
    assert grid[0] == fp32["river"][0]  # no backbone layer read: the exit layers and exit head only
    assert fp32["river"][5] - grid[5] > 2.5 * (grid[5] - grid[0])  # 5 backbone layers: ~1/3 of their fp32 bytes


def test_the_cli_flag_is_checked_before_any_model_loads(tmp_path, smollm2_gguf):
    import argparse

    from river_hf import cli_args
    from river_hf.river.config import RIVER_SETTINGS

    parser = argparse.ArgumentParser()
    cli_args.add_river_arguments(parser)
    assert cli_args.river_overrides(parser.parse_args(["--backbone-grid", "off"])) == {"backbone_grid": "off"}
    assert cli_args.river_overrides(parser.parse_args(["--backbone-grid", smollm2_gguf])) == {"backbone_grid": smollm2_gguf}
    with pytest.raises(RiverError, match="--backbone-grid .*nope.gguf': no such file"):
        cli_args.river_overrides(parser.parse_args(["--backbone-grid", str(tmp_path / "nope.gguf")]))
    readme = tmp_path / "README.md"
    readme.write_text("# not a GGUF file")
    for bad, why in ((str(readme), "not a GGUF file"), (str(tmp_path), "a directory"), ("", "an empty path")):
        with pytest.raises(RiverError, match=f"--backbone-grid .*: {why}"):
            cli_args.river_overrides(parser.parse_args(["--backbone-grid", bad]))
    assert "backbone_grid" in RIVER_SETTINGS


def test_a_named_file_that_gives_no_grid_warns_and_changes_nothing(tmp_path, smollm2_path):
    from river_hf import RiverForCausalLM

    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)  # GGUF's magic, then a broken header
    river = RiverForCausalLM.from_pretrained(smollm2_path, tau=0.9, backbone_kernel="river-fp32",
                                             backbone_grid=str(not_gguf))
    with pytest.warns(UserWarning, match="could not be read as a GGUF file.*fp32 weights"):
        river.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
    info = river.river_stats["backbone_kernel"]
    assert info["kernel"] == "river-fp32" and info["grid"]["kept"] == 0


def test_the_gguf_tensor_table_is_kept_after_the_first_read(tmp_path, monkeypatch, smollm2_gguf):
    """The second read of a GGUF (another process) takes the kept table, not gguf-py's full parse;
    the same tensors and bytes either way. A changed file, or a kept table that cannot be used, is
    parsed again."""
    import shutil

    import gguf

    from river_hf.quant import gguf_index

    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    shutil.copyfile(smollm2_gguf, path)
    parsed = []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, *args, **kwargs):
            parsed.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    arch, first = gguf_index.gguf_tensors(str(path))
    assert arch == "llama" and len(parsed) == 1
    reference = {t.name: t for t in gguf.gguf_reader.GGUFReader(str(path)).tensors}
    arch2, again = gguf_index.gguf_tensors(str(path))
    assert arch2 == arch and len(parsed) == 1 and again.keys() == reference.keys()
    for name, t in again.items():
        ref = reference[name]
        assert t.format == ref.tensor_type.name and t.shape == tuple(int(d) for d in ref.shape)
        assert np.array_equal(t.data, np.asarray(ref.data).reshape(-1).view(np.uint8))
    (index,) = (tmp_path / "cache" / "gguf-index").iterdir()
    kept = index.read_text()
    table = json.loads(kept)
    broken = ["{not json", "[]", "null", "42", json.dumps({**table, "tensors": []}),
              json.dumps({**table, "architecture": 3}),
              json.dumps({**table, "tensors": [[*table["tensors"][0][:3], -1, table["tensors"][0][4]]]}),
              json.dumps({**table, "tensors": [[table["tensors"][0][0], table["tensors"][0][1], None, 0, 1]]})]
    for n, text in enumerate(broken, start=2):  # each is parsed again (and the table kept again)
        index.write_text(text)
        assert gguf_index.gguf_tensors(str(path))[1].keys() == reference.keys()
        assert len(parsed) == n and json.loads(index.read_text()) == table, text
    parsed.clear()
    parsed.append(None)
    parsed.append(None)
    path.write_bytes(path.read_bytes())  # a new modification time: the kept table is not this file's
    os.utime(path, ns=(1, 1))
    gguf_index.gguf_tensors(str(path))
    assert len(parsed) == 3
    with pytest.raises(ValueError):
        (tmp_path / "notes.gguf").write_text("not a GGUF file")
        gguf_index.gguf_tensors(str(tmp_path / "notes.gguf"))
