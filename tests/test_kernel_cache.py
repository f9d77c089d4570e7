"""The measured kernel choice: saved with a River folder and reused at load, and the kernels.json
cache (validation, merged locked writes, loaded-machine entries, ``river-hf kernels``).

Timings are scripted (``KernelTuner.measure`` replaced), so nothing here depends on this
machine's speed.
"""

from __future__ import annotations

import json
import math
import re
import threading
import warnings

import pytest
import torch
from torch import nn

from river_hf import RiverForCausalLM, enable_river
from river_hf.cli import main
from river_hf.quant import KERNELS, KernelTuner, WeightOnlyKernel, autotune, machine_id
from river_hf.quant.autotune import FORMAT_VERSION, read_cache, update_cache

#: the candidate set of the kernels.json tests: two int4 kernels every machine has (what is tested
#: there is the cache, not the registry's full candidate list)
INT4 = (KERNELS["torch-int4"], KERNELS["quanto-int4"])


class Script:
    """A stand-in for ``KernelTuner.measure``: fixed µs per kernel, calls counted."""

    def __init__(self, **us):
        self.us = {k.replace("_", "-"): v for k, v in us.items()}
        self.calls = []

    def __call__(self, tuner, candidates, linear, rows=1):
        spec = autotune.LinearSpec.of(linear)
        if rows == 1:  # one-row choices are counted; a prompt-kernel measurement (rows > 1) is not
            self.calls.append(spec.shape)
        return {k.name: self.us.get(k.name, 100.0) for k in candidates}


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """A quiet machine unless a test scripts the load: a measurement under load is invalid (the prior
    ranking decides), so no test here may read this busy machine's real load average."""
    monkeypatch.setattr(autotune, "load_average", lambda: 0.1)
    monkeypatch.setattr(autotune, "usable_cpus", lambda: 2)
    monkeypatch.setattr(KernelTuner, "retry_pause_s", 0.0)  # an invalid (tied) measurement is retried at once


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache folder, measurement on (conftest turns it off for the other tests)."""
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("RIVER_HF_AUTOTUNE", "1")
    monkeypatch.setattr(autotune, "load_average", lambda: 0.1)
    return tmp_path / "cache" / "kernels.json"


def written_over_the_bar(err: str, start: str) -> int:
    """How many lines starting with ``start`` ``err`` holds, after checking that each was written as
    tqdm.write writes over a progress bar: on a terminal line of its own, the bar cleared (``\\r``,
    blanks, ``\\r``) just before it where one was drawn; a plain print would follow the bar's text."""
    rows = [row for row in err.split("\n") if start in row]  # what one terminal line shows
    for row in rows:
        *before, last = row.split("\r")
        assert last.startswith(start) and (not before or before[-1].strip() == ""), repr(row)
    return len(rows)


def exit_logits(model) -> torch.Tensor:
    ids = torch.arange(3, 15)[None]
    with torch.no_grad(), model.river_mode("exit"):
        return model(input_ids=ids).logits


def kernels_used(model) -> set[str]:
    return {k["kernel"] for k in model.river_kernels()}


# -- 1. the saved kernel choice -------------------------------------------------------------------


def test_saved_folder_keeps_its_kernels_where_this_machine_would_measure_others(tmp_path, cache, monkeypatch,
                                                                                scripted_tuner, tiny_llama):
    first = scripted_tuner(Script(quanto_int4=50.0, torch_int4=90.0))  # the saving machine: quanto is faster
    model = enable_river(tiny_llama(), tau=0.9, backend="int4", exit_head="int4", progress=False)
    assert first.calls and kernels_used(model) == {"quanto-int4"}
    choice = model.river_config.kernel_choice
    assert choice == {"int4:128x128": "quanto-int4", "int4:128x64": "quanto-int4", "int4:128x256": "quanto-int4",
                      "int4:256x128": "quanto-int4"}
    reference = exit_logits(model)
    folder = tmp_path / "river-folder"
    model.save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["river"]["kernel_choice"] == choice

    # another machine (its own kernels.json) where torch-int4 measures faster
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "other-machine"))
    second = scripted_tuner(Script(quanto_int4=90.0, torch_int4=50.0))
    fresh = enable_river(tiny_llama(), tau=0.9, backend="int4", exit_head="int4", progress=False)
    assert kernels_used(fresh) == {"torch-int4"}  # a fresh build still measures
    second.calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: every saved kernel exists here
        loaded = RiverForCausalLM.from_pretrained(str(folder), progress=False)
    assert second.calls == []  # nothing measured: the saved choice decided
    assert kernels_used(loaded) == {"quanto-int4"} and loaded.river_config.kernel_choice == choice
    assert torch.equal(exit_logits(loaded), reference)  # the same model as the one saved
    monkeypatch.setenv("RIVER_HF_AUTOTUNE", "0")  # no measurement: the first candidate (torch-int4) otherwise
    assert kernels_used(RiverForCausalLM.from_pretrained(str(folder), progress=False)) == {"quanto-int4"}


def test_saved_kernel_missing_here_warns_once_and_falls_back(tmp_path, cache, monkeypatch, scripted_tuner, tiny_llama):
    scripted_tuner(Script(quanto_int4=50.0, torch_int4=90.0))
    model = enable_river(tiny_llama(), tau=0.9, backend="int4", exit_head="int4", progress=False)
    folder = tmp_path / "river-folder"
    model.save_pretrained(folder)

    available = WeightOnlyKernel.available
    monkeypatch.setattr(WeightOnlyKernel, "available",
                        lambda self, device="cpu": self.name != "quanto-int4" and available(self, device))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = RiverForCausalLM.from_pretrained(str(folder), progress=False)
    ours = [w for w in caught if "saved kernel choice" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    text = str(ours[0].message)
    for shape in ("int4:128x128", "int4:128x64", "int4:128x256", "int4:256x128"):
        assert shape in text
    assert "not available on this machine" in text and "using torch-int4" in text
    assert kernels_used(loaded) == {"torch-int4"}
    assert set(loaded.river_config.kernel_choice.values()) == {"torch-int4"}  # what it really runs now


def test_kernel_choice_is_checked():
    from river_hf import RiverConfig, RiverError

    assert RiverConfig(kernel_choice={"int4:896x4864": "torch-int4"}).to_dict()["kernel_choice"] == {
        "int4:896x4864": "torch-int4"}
    with pytest.raises(RiverError, match="kernel_choice"):
        RiverConfig(kernel_choice={"int4:896x4864": 3})
    with pytest.raises(RiverError, match="kernel_choice"):
        RiverConfig(kernel_choice=["torch-int4"])


# -- 2. kernels.json ------------------------------------------------------------------------------


def key_of(linear: nn.Linear, candidates=INT4) -> str:
    spec = autotune.LinearSpec.of(linear)
    return autotune._key(machine_id(), spec.shape, spec.dtype_name, spec.bias, [k.name for k in candidates])


def good_entry(linear: nn.Linear, **overrides) -> dict:
    from river_hf import __version__

    spec = autotune.LinearSpec.of(linear)
    entry = {"machine": machine_id(), "shape": spec.shape, "dtype": spec.dtype_name, "bias": spec.bias,
             "candidates": sorted(k.name for k in INT4), "timings_us": {"torch-int4": 10.0, "quanto-int4": 20.0},
             "kernel": "torch-int4", "measured_at": 1.7e9, "load_avg_1m": 0.2, "cpus": 2, "river_hf_version": __version__}
    entry.update(overrides)
    return entry


@pytest.mark.parametrize("damage", [
    {"timings_us": {"torch-int4": float("nan"), "quanto-int4": 20.0}},
    {"timings_us": {"torch-int4": "fast", "quanto-int4": 20.0}},
    {"timings_us": {"torch-int4": -5.0, "quanto-int4": 20.0}},
    {"timings_us": {"torch-int4": True, "quanto-int4": 20.0}},
    {"timings_us": {"torch-int4": 10.0, "quanto-int4": 20.0, "warp-int4": 1.0}},
    {"timings_us": {"torch-int4": 10.0}},
    {"measured_at": "yesterday"},
    {"cpus": 0},
    {"dtype": "no-such-dtype"},
    {"shape": "1x1"},
])
def test_invalid_entries_are_dropped_and_measured_again(tmp_path, damage, scripted_tuner):
    linear = nn.Linear(128, 64)
    path = tmp_path / "kernels.json"
    key = key_of(linear)
    path.write_text(json.dumps({"format": FORMAT_VERSION, "entries": {key: good_entry(linear, **damage)}}))
    s = scripted_tuner(Script(torch_int4=30.0, quanto_int4=40.0))
    tuner = KernelTuner(path)
    assert key in tuner.invalid
    kernel, timings = tuner.choose(INT4, linear)
    assert s.calls == ["128x64"] and kernel.name == "torch-int4" and timings == {"torch-int4": 30.0, "quanto-int4": 40.0}
    entries, invalid, _ = read_cache(path)
    assert invalid == {} and entries[key]["timings_us"] == timings  # the file now holds the new, valid entry


def test_old_flat_cache_with_nan_timings_is_measured_again(tmp_path, scripted_tuner):
    """The layout before format 2 (``{key: timings}``): a NaN there used to decide by chance."""
    linear = nn.Linear(128, 64)
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps({key_of(linear): {"torch-int4": math.nan, "quanto-int4": 20.0}}))
    s = scripted_tuner(Script(torch_int4=30.0, quanto_int4=10.0))
    assert KernelTuner(path).choose(INT4, linear)[0].name == "quanto-int4"
    assert s.calls == ["128x64"]
    assert json.loads(path.read_text())["format"] == FORMAT_VERSION


def test_entry_of_another_version_is_measured_again(tmp_path, scripted_tuner):
    linear = nn.Linear(128, 64)
    path = tmp_path / "kernels.json"
    key = key_of(linear)
    update_cache(path, {key: good_entry(linear, river_hf_version="0.0.1")})
    s = scripted_tuner(Script(torch_int4=30.0, quanto_int4=40.0))
    tuner = KernelTuner(path)
    tuner.choose(INT4, linear)
    assert s.calls == ["128x64"] and "0.0.1" in tuner.remeasured[key]


def test_timings_of_river_hfs_own_kernel_in_another_build_are_measured_again(tmp_path, monkeypatch, scripted_tuner):
    """A changed ``csrc/river_int4.cpp`` (or flags, or torch) makes river-int4's cached timings stale: the
    entry records the build it timed, and another build (or none recorded) measures the shape again."""
    from river_hf.quant import kernel_cache

    candidates = (KERNELS["torch-int4"], KERNELS["river-int4"])
    linear = nn.Linear(128, 64)
    path = tmp_path / "kernels.json"
    key = key_of(linear, candidates)
    build = {"id": "river_int4_aaaaaaaaaaaaaaaa"}
    monkeypatch.setattr(kernel_cache.river_int4, "build_id", lambda: build["id"])
    s = scripted_tuner(Script(torch_int4=30.0, river_int4=20.0))
    KernelTuner(path).choose(candidates, linear)
    assert read_cache(path)[0][key]["builds"] == {"river-int4": "river_int4_aaaaaaaaaaaaaaaa"}
    KernelTuner(path).choose(candidates, linear)  # the same build: the entry is trusted
    assert s.calls == ["128x64"]

    build["id"] = "river_int4_bbbbbbbbbbbbbbbb"
    tuner = KernelTuner(path)
    tuner.choose(candidates, linear)
    assert s.calls == ["128x64"] * 2 and "another build" in tuner.remeasured[key]
    assert read_cache(path)[0][key]["builds"] == {"river-int4": "river_int4_bbbbbbbbbbbbbbbb"}

    old = {k: v for k, v in read_cache(path)[0][key].items() if k != "builds"}  # written before builds were recorded
    update_cache(path, {key: old})
    tuner = KernelTuner(path)
    tuner.choose(candidates, linear)
    assert len(s.calls) == 3 and "before river-hf recorded" in tuner.remeasured[key]

    KernelTuner(path).choose(INT4, linear)  # no river-hf kernel among the candidates: no build recorded
    assert "builds" not in read_cache(path)[0][key_of(linear)]


def test_entries_measured_under_load_are_measured_again_once_the_machine_is_quiet(tmp_path, monkeypatch,
                                                                                  scripted_tuner):
    linear = nn.Linear(128, 64)
    path = tmp_path / "kernels.json"
    monkeypatch.setattr(autotune, "usable_cpus", lambda: 2)
    load = {"now": 6.0}  # 3 runnable threads per core: loaded (LOADED_LOAD_FACTOR 1.25)
    monkeypatch.setattr(autotune, "load_average", lambda: load["now"])
    s = scripted_tuner(Script(torch_int4=30.0, quanto_int4=40.0))
    KernelTuner(path).choose(INT4, linear)
    entry = read_cache(path)[0][key_of(linear)]
    assert entry["load_avg_1m"] == 6.0 and entry["cpus"] == 2 and s.calls == ["128x64"]

    KernelTuner(path).choose(INT4, linear)  # still loaded: measuring now would be as noisy; the entry serves
    assert s.calls == ["128x64"]

    load["now"] = 2.4  # at or below 1.25 x 2 cores: quiet
    s.us = {"torch-int4": 50.0, "quanto-int4": 20.0}
    tuner = KernelTuner(path)
    assert tuner.choose(INT4, linear)[0].name == "quanto-int4"
    assert s.calls == ["128x64", "128x64"] and "under load" in tuner.remeasured[key_of(linear)]
    assert read_cache(path)[0][key_of(linear)]["load_avg_1m"] == 2.4

    KernelTuner(path).choose(INT4, linear)  # a quiet measurement is trusted
    assert len(s.calls) == 2


def test_concurrent_writers_keep_every_entry(tmp_path, scripted_tuner):
    path = tmp_path / "kernels.json"
    scripted_tuner(Script())
    shapes = [nn.Linear(32 * (i + 1), 64) for i in range(8)]
    tuners = [KernelTuner(path) for _ in shapes]  # all read the (empty) file before anyone writes
    start = threading.Barrier(len(shapes))

    def work(tuner, linear):
        start.wait()
        tuner.choose(INT4, linear)

    threads = [threading.Thread(target=work, args=pair) for pair in zip(tuners, shapes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    entries, invalid, fmt = read_cache(path)
    assert fmt == FORMAT_VERSION and invalid == {}
    assert sorted(e["shape"] for e in entries.values()) == sorted(f"{m.in_features}x64" for m in shapes)


def test_a_newer_format_is_left_alone(tmp_path, scripted_tuner):
    path = tmp_path / "kernels.json"
    newer = json.dumps({"format": FORMAT_VERSION + 1, "entries": {"x": 1}})
    path.write_text(newer)
    scripted_tuner(Script())
    KernelTuner(path).choose(INT4, nn.Linear(128, 64))
    assert path.read_text() == newer


# -- the CLI ----------------------------------------------------------------------------------------


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(["kernels", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_lists_and_remeasures(cache, capsys, scripted_tuner):
    s = scripted_tuner(Script(torch_int4=30.0, quanto_int4=40.0))
    tuner = KernelTuner()
    tuner.choose(INT4, nn.Linear(128, 64))
    tuner.choose(INT4, nn.Linear(256, 128, bias=False))
    data = json.loads(cache.read_text())
    data["entries"]["bad"] = {"timings_us": {"torch-int4": "x"}}
    cache.write_text(json.dumps(data))

    code, out, _ = run_cli(capsys, "--list", "--json")
    listing = json.loads(out)
    assert code == 0 and listing["file"] == str(cache) and "bad" in listing["invalid"]
    rows = {r["shape"]: r for r in listing["entries"]}
    assert set(rows) == {"128x64", "256x128"}
    assert rows["128x64"]["kernel"] == "torch-int4" and rows["128x64"]["timings_us"] == {"torch-int4": 30.0,
                                                                                          "quanto-int4": 40.0}
    assert rows["128x64"]["load_avg_1m"] == 0.1 and rows["128x64"]["status"] == "ok" and rows["128x64"]["measured_at"]
    code, out, _ = run_cli(capsys)  # the table
    assert code == 0 and "128x64" in out and "torch-int4 30.0" in out and "load 0.10/" in out and "1 invalid" in out

    s.us = {"torch-int4": 60.0, "quanto-int4": 40.0}
    code, out, _ = run_cli(capsys, "--remeasure", "128X64")
    assert code == 0 and "128x64" in out and "quanto-int4" in out and s.calls[-1] == "128x64"
    entries = read_cache(cache)[0]
    by_shape = {e["shape"]: e for e in entries.values()}
    assert by_shape["128x64"]["timings_us"] == {"torch-int4": 60.0, "quanto-int4": 40.0}
    assert by_shape["256x128"]["timings_us"] == {"torch-int4": 30.0, "quanto-int4": 40.0}  # untouched

    code, out, _ = run_cli(capsys, "--remeasure")
    assert code == 0 and "dropped 2" in out and read_cache(cache)[0] == {}  # (the invalid one went at the last write)
    calls = len(s.calls)
    KernelTuner().choose(INT4, nn.Linear(128, 64))
    assert len(s.calls) == calls + 1  # the next build measures


@pytest.mark.parametrize("argv, message", [
    (["--remeasure", "896by4864"], "is not IN x OUT"),
    (["--remeasure", "0x5"], "is not IN x OUT"),
    (["--remeasure", "896x4864"], "no cached timings for 896x4864 on this machine"),
])
def test_cli_bad_input_is_one_line_and_exit_2(cache, capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("river-hf: error: ") and message in err


def test_cli_list_and_remeasure_exclude_each_other(cache, capsys):
    with pytest.raises(SystemExit) as e:
        main(["kernels", "--list", "--remeasure"])
    assert e.value.code == 2 and "not allowed" in capsys.readouterr().err



def test_a_first_build_says_which_shapes_it_is_timing_and_a_cached_one_is_silent(cache, capsys, scripted_tuner,
                                                                                 tiny_llama):
    """With the progress bar on, each shape the tuner measures gets one stderr line (a first build on a
    machine sits there for seconds per shape), written through tqdm over the build's bar (the bar
    cleared before the line, redrawn after it: no line starts in the middle of the bar); a second
    build reads the cache and prints none; a build without progress prints none either, and the
    tuner keeps no callback afterwards."""
    scripted_tuner(Script(torch_int4=30.0, quanto_int4=40.0))
    enable_river(tiny_llama(), tau=0.9, backend="int4", progress=True)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("[river-hf] timing the exit kernels")]
    assert lines and all("once per machine, cached in" in line and str(cache) in line for line in lines)
    assert written_over_the_bar(err, "[river-hf] timing") == len(lines)
    assert any("not cached" in line for line in lines)
    enable_river(tiny_llama(), tau=0.9, backend="int4", progress=True)
    assert "[river-hf] timing" not in capsys.readouterr().err
    tuner = KernelTuner(cache.parent / "other.json")
    enable_river(tiny_llama(), tau=0.9, backend="int4", progress=False, tuner=tuner)
    assert "[river-hf] timing" not in capsys.readouterr().err and tuner.measured > 0 and tuner.on_measure is None


def test_cli_list_of_a_named_file_that_is_missing_or_not_a_cache_is_an_error(cache, tmp_path, capsys):
    """--file names a file: missing or not a kernels.json is one error line and exit 2 (the default
    cache may be absent: that lists as empty, exit 0)."""
    code, out, _ = run_cli(capsys, "--list")
    assert code == 0 and "no kernel timings cached" in out
    code, _, err = run_cli(capsys, "--list", "--file", str(tmp_path / "nope" / "k.json"))
    assert code == 2 and "no such file" in err and err.count("\n") == 1
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = run_cli(capsys, "--list", "--file", str(bad))
    assert code == 2 and "not a kernels.json" in err
    code, _, err = run_cli(capsys, "--list", "--file", str(tmp_path))
    assert code == 2 and "a folder, not a file" in err and str(tmp_path / "kernels.json") in err
    # the same check for the other actions: re-measuring or dropping a file that is not there is an error
    for action in (["--remeasure", "896x896"], ["--remeasure"]):
        code, _, err = run_cli(capsys, *action, "--file", str(tmp_path / "missing.json"))
        assert code == 2 and "no such file" in err and err.count("\n") == 1
    assert not (tmp_path / "missing.json").exists()


def test_alternating_medians_warms_up_untimed_and_reverses_the_order_every_other_round(monkeypatch):
    order = []
    ticks = iter(range(100))
    monkeypatch.setattr(autotune.time, "perf_counter", lambda: float(next(ticks)))  # each run takes 1 s

    medians = autotune.alternating_medians({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                                           rounds=4, calls={"a": 2, "b": 1})
    assert order == ["b", "a", "a", "b", "b", "a", "a", "b", "b", "a"]  # an untimed warm-up round, then alternating
    assert medians == {"a": 0.5e6, "b": 1e6}  # µs per kernel call: a run of "a" makes 2 calls


def test_dense_mode_choices_share_the_exit_kernels_cache_file(cache, monkeypatch, capsys, scripted_tuner):
    """Lossless verify and dLLM-Cache's partial steps ask the same tuner: one kernels.json, one entry
    per shape and row count beside the one-row exit-kernel entries, trusted by the same rules,
    listed and re-measured by ``river-hf kernels``."""
    from river_hf.quant import dense_river as dense

    scripted_tuner(Script(torch_int4=30.0, quanto_int4=40.0))
    KernelTuner().choose(INT4, nn.Linear(128, 64))
    measured = []

    def measure():
        measured.append(1)
        return {"torch": 5.0, "onednn": 2.0}

    spec = autotune.LinearSpec(128, 64, False)
    assert KernelTuner().choose_mode(spec, 8, ("torch", "onednn"), measure) == ("onednn", {"torch": 5.0, "onednn": 2.0})
    assert KernelTuner().choose_mode(spec, 8, ("torch", "onednn"), measure)[0] == "onednn" and len(measured) == 1
    KernelTuner().choose_mode(spec, 4, ("torch", "onednn"), measure)  # another row count: its own entry
    entries = read_cache(cache)[0]
    assert sorted(e.get("rows", 1) for e in entries.values()) == [1, 4, 8] and len(measured) == 2
    # one row (route mode's backbone kernel): its own entry, trusted when read back
    assert KernelTuner().choose_mode(spec, 1, ("torch", "onednn"), measure)[0] == "onednn" and len(measured) == 3
    assert KernelTuner().choose_mode(spec, 1, ("torch", "onednn"), measure)[0] == "onednn" and len(measured) == 3
    with pytest.raises(ValueError, match="rows must be >= 1"):
        KernelTuner().choose_mode(spec, 0, ("torch", "onednn"), measure)
    with pytest.raises(ValueError, match="not dense modes"):
        KernelTuner().choose_mode(spec, 8, ("torch-int4",), measure)
    # an entry whose timings name weight-only kernels at rows > 1 is not trusted
    key = next(k for k, e in entries.items() if e.get("rows") == 8)
    bad = dict(entries[key], timings_us={"torch-int4": 1.0, "onednn": 2.0}, candidates=["onednn", "torch-int4"])
    assert "unknown kernel" in autotune._entry_problem(key, bad)

    code, out, _ = run_cli(capsys)
    assert code == 0 and re.search(r"128x64 +8 float32 +no bias +-> onednn", out) and "onednn 2.0" in out
    assert re.search(r"128x64 +1 float32", out) and "rows > 1: the fp32 mode of lossless" in out
    monkeypatch.setattr(dense, "measure_modes", lambda names, i, o, rows, **kw: {"torch": 1.0, "onednn": 3.0})
    code, out, _ = run_cli(capsys, "--remeasure", "128x64")
    assert code == 0 and "128x64 x8 rows float32 no bias: torch" in out
    kernels = sorted((e.get("rows", 1), e["kernel"]) for e in read_cache(cache)[0].values())
    assert kernels == [(1, "torch"), (1, "torch-int4"), (4, "torch"), (8, "torch")]  # the exit kernel's entry kept


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_cache_and_settings_files_get_the_mode_of_other_files(tmp_path, umask):
    """kernels.json and a RiverConfig.to_file are written through a temporary file (mkstemp: 0600);
    the final file must get what an ordinary open gives under the umask, like every other cache
    file (issue 40: kernels.json was 0600 beside 0644 model files)."""
    import os
    import stat

    from river_hf import RiverConfig

    old = os.umask(umask)
    try:
        update_cache(tmp_path / "kernels.json", {})
        RiverConfig(tau=0.5).to_file(tmp_path / "river.json")
    finally:
        os.umask(old)
    for name in ("kernels.json", "river.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name
