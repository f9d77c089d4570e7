"""A kernel tuner a busy machine cannot fool (issue 38): invalid measurements are retried, then the
prior ranking per CPU feature set decides; nothing invalid is cached or saved as measured, and a
folder whose choice came from the prior is re-validated at a quiet load.

Timings, the load average, the CPU's feature set and the retry pause are all scripted: nothing
here reads this machine's speed or load.
"""

from __future__ import annotations

import json
import warnings

import pytest
from torch import nn

from river_hf import RiverForCausalLM, enable_river
from river_hf.cli import main
from river_hf.quant import KERNELS, KernelTuner, autotune, get_backend, kernel_cache, prior
from river_hf.quant.autotune import read_cache
from river_hf.quant.choice import PRIOR_SUFFIX
from test_kernel_cache import written_over_the_bar

BUSY = 20_000.0  # µs: the scheduler's time slice, what every candidate measured with load 5 on 2 cores


class Script:
    """Stand-in for ``KernelTuner.measure``: one-row calls answer from ``rounds`` in turn (the last
    one repeats), each ``{kernel: µs}`` (missing kernels: ``default``); counts the one-row calls."""

    def __init__(self, *rounds, default=None):
        self.rounds, self.default, self.calls = list(rounds), default, []

    def __call__(self, tuner, candidates, linear, rows=1):
        if rows != 1:
            return {k.name: 100.0 for k in candidates}
        us = self.rounds[min(len(self.calls), len(self.rounds) - 1)]
        self.calls.append(autotune.LinearSpec.of(linear).shape)
        return {k.name: us.get(k.name, self.default) for k in candidates}


def busy_round(*names) -> dict:
    """Every candidate within 0.5 % of 20 ms."""
    return {n: BUSY * (1 + 0.0025 * i) for i, n in enumerate(names)}


QUIET = {"torch-int4": 150.0, "quanto-int4": 190.0, "ark-int4": 400.0}  # tinygemm fastest (the Zen 4 figures)
# the scripted machines have no AVX-512 VNNI (the `machine` fixture turns river-int4 off): the Zen 4 world
INT4 = tuple(k for k in get_backend("int4").candidates if k.name != "river-int4")


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """Measurement on in a private cache; load, cores, feature set and pauses scripted. Returns a
    dict whose ``load``/``features`` a test may change; ``sleeps`` records the retry pauses."""
    state = {"load": 0.1, "features": "AVX-512", "sleeps": []}
    monkeypatch.setenv("RIVER_HF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("RIVER_HF_NO_EXTENSIONS", "1")
    monkeypatch.setenv("RIVER_HF_AUTOTUNE", "1")
    monkeypatch.setattr(autotune, "load_average", lambda: state["load"])
    monkeypatch.setattr(autotune, "usable_cpus", lambda: 2)
    monkeypatch.setattr(autotune, "cpu_features", lambda: state["features"])
    monkeypatch.setattr(autotune.time, "sleep", lambda s: state["sleeps"].append(s))
    state["file"] = tmp_path / "cache" / "kernels.json"
    return state


def kernels_used(model) -> set[str]:
    return {k["kernel"] for k in model.river_kernels()}


SHAPES = {"int4:128x128", "int4:128x64", "int4:128x256", "int4:256x128"}  # the exit Linears and the head


# -- (a) a busy machine ---------------------------------------------------------------------------------


@pytest.mark.parametrize("load", [0.1, 5.0])
def test_a_busy_measurement_picks_the_prior_and_caches_nothing_as_measured(machine, monkeypatch, capsys, load,
                                                                           scripted_tuner, tiny_llama):
    """All candidates ~20 ms (the time slice): with the load average quiet (a burst it missed) the
    timings are invalid by themselves (within 2 %, far above the bandwidth floor) and are taken 3
    times; at load 5 on 2 cores once (a 1-minute average does not drop in a pause). Either way the
    exit Linears get the prior's kernel, which is what a quiet measurement picks on such a CPU."""
    scripted_tuner(Script(QUIET))
    quiet = kernels_used(enable_river(tiny_llama(), tau=0.9, backend="int4", exit_head="int4", progress=False,
                                      tuner=KernelTuner(False)))
    assert quiet == {"torch-int4"}

    machine["load"] = load
    s = scripted_tuner(Script(busy_round("torch-int4", "ark-int4", "quanto-int4")))
    model = enable_river(tiny_llama(), tau=0.9, backend="int4", exit_head="int4", progress=True)
    assert kernels_used(model) == quiet  # the prior for AVX-512 (without AMX): tinygemm
    tries = 1 if load > 2.5 else 3
    assert sorted(s.calls) == sorted(key.split(":")[1] for key in SHAPES for _ in range(tries))
    assert machine["sleeps"] == ([] if tries == 1 else [KernelTuner.retry_pause_s] * 2 * len(SHAPES))

    choice = model.river_config.kernel_choice
    assert {k: v for k, v in choice.items() if PRIOR_SUFFIX not in k} == dict.fromkeys(SHAPES, "torch-int4")
    marks = {k.removesuffix(PRIOR_SUFFIX): v for k, v in choice.items() if PRIOR_SUFFIX in k}
    assert set(marks) == SHAPES and all(v.startswith("AVX-512: ") for v in marks.values())
    assert all(("load 5.0 on 2 cores" in v) == (load > 2.5) and "all candidates within" in v for v in marks.values())

    entries, _, _ = read_cache(machine["file"])
    assert len(entries) == len(SHAPES)
    assert all(e["invalid"] and e["prior"] == "AVX-512" and e["kernel"] == "torch-int4" for e in entries.values())

    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "look invalid" in line]
    assert len(lines) == len(SHAPES) and all("using the prior ranking for AVX-512 (torch-int4)" in line for line in lines)
    assert written_over_the_bar(err, "[river-hf] kernel timings for") == len(SHAPES)  # tqdm.write: the bar unbroken
    assert any("128x256 look invalid (all candidates within 0.5 %" in line and "bandwidth-floor limit" in line
               for line in lines)

    monkeypatch.setattr(kernel_cache, "load_average", lambda: machine["load"])  # what `river-hf kernels` reads
    assert main(["kernels", "--list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["entries"]
    assert all(r["kernel"] == "torch-int4" for r in rows)
    assert all(("the prior ranking for AVX-512 decides" if load > 2.5 else "the machine is quiet now") in r["status"]
               for r in rows)

    s.calls.clear()  # a second build: the flagged entries serve while loaded, are measured again when quiet
    again = enable_river(tiny_llama(), tau=0.9, backend="int4", exit_head="int4", progress=False)
    assert kernels_used(again) == quiet and len(s.calls) == (0 if load > 2.5 else 3 * len(SHAPES))


def test_an_entry_cached_before_the_rules_that_they_find_invalid_is_not_reused(machine, scripted_tuner):
    """A kernels.json entry of an older build with time-slice timings (no "invalid" flag): not
    trusted as a measurement; quiet now, so measured again."""
    linear = nn.Linear(128, 64)
    s = scripted_tuner(Script({"torch-int4": BUSY, "quanto-int4": BUSY * 1.001, "ark-int4": 19_000.0}))
    tuner = KernelTuner(machine["file"])
    tuner.retries = 0
    assert tuner.choose(INT4, linear)[0].name == "torch-int4" and tuner.last_prior.startswith("AVX-512: ")
    data = json.loads(machine["file"].read_text())
    for e in data["entries"].values():  # as an older river-hf wrote it: the fastest, no flag
        e.pop("invalid"), e.pop("prior")
        e["kernel"] = "ark-int4"
    machine["file"].write_text(json.dumps(data))
    s.rounds = [QUIET]
    tuner = KernelTuner(machine["file"])
    assert tuner.choose(INT4, linear)[0].name == "torch-int4" and tuner.last_prior is None
    assert len(s.calls) == 2 and "look invalid" in next(iter(tuner.remeasured.values()))


# -- (b) one noisy round, then a valid one ----------------------------------------------------------------


def test_a_noisy_round_then_a_valid_one_uses_the_valid_one(machine, scripted_tuner):
    machine["features"] = "AVX-512/AMX"  # its prior (ARK) would differ from the valid measurement
    s = scripted_tuner(Script(busy_round("torch-int4", "ark-int4", "quanto-int4"), QUIET))
    tuner = KernelTuner(machine["file"])
    kernel, timings = tuner.choose(INT4, nn.Linear(128, 64))
    assert kernel.name == "torch-int4" and timings == QUIET and tuner.last_prior is None
    assert s.calls == ["128x64", "128x64"] and machine["sleeps"] == [KernelTuner.retry_pause_s]
    (entry,) = read_cache(machine["file"])[0].values()
    assert "invalid" not in entry and entry["kernel"] == "torch-int4"
    assert KernelTuner(machine["file"]).choose(INT4, nn.Linear(128, 64))[0].name == "torch-int4"
    assert len(s.calls) == 2  # a valid entry is trusted


def test_invalid_reason_rules():
    nbytes = prior.weight_bytes(896, 4864, 4)  # 2.18 MB: limit 50 x 21.8 µs + 1 ms = 2.09 ms
    assert prior.invalid_reason({"torch-int4": 150.0, "quanto-int4": 190.0}, nbytes, 0.3, 2) is None
    assert "within 1.0 %" in prior.invalid_reason({"a": 200.0, "b": 202.0}, nbytes, 0.3, 2)
    far = prior.invalid_reason({"a": 5000.0, "b": 9000.0}, nbytes, 0.3, 2)
    assert far.startswith("the fastest, 5000 µs, 2x the bandwidth-floor limit of 2090 µs")
    assert prior.invalid_reason({"a": 150.0, "b": 190.0}, nbytes, 5.0, 2).startswith("load 5.0 on 2 cores")
    assert prior.invalid_reason({"a": 150.0, "b": 190.0}, nbytes, 2.5, 2) is None  # at the threshold: quiet
    assert prior.invalid_reason({"a": 150.0, "b": 190.0}, nbytes, None, 2) is None  # no load average (Windows)
    everything = prior.invalid_reason(busy_round("a", "b"), nbytes, 5.0, 2)
    assert everything.count("; ") == 2


# -- (c) a saved folder whose choice came from the prior ---------------------------------------------------


def test_a_folder_saved_under_load_is_revalidated_at_a_quiet_load(tmp_path, machine, capsys, scripted_tuner,
                                                                  tiny_llama):
    machine.update(load=5.0, features="AVX-512/AMX")  # under load, the prior for AMX: ARK
    s = scripted_tuner(Script(busy_round("torch-int4", "ark-int4", "quanto-int4")))
    model = enable_river(tiny_llama(), tau=0.9, backend="int4", exit_head="int4", progress=False)
    assert kernels_used(model) == {"ark-int4"}
    folder = tmp_path / "river-folder"
    model.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())["river"]["kernel_choice"]
    assert {k for k in saved if k.endswith(PRIOR_SUFFIX)} == {k + PRIOR_SUFFIX for k in SHAPES}

    s.calls.clear()  # still loaded: reused as saved, nothing measured, the marks kept
    loaded = RiverForCausalLM.from_pretrained(str(folder), progress=True)
    assert s.calls == [] and kernels_used(loaded) == {"ark-int4"} and loaded.river_config.kernel_choice == saved
    assert "re-validated" not in capsys.readouterr().err

    machine["load"] = 0.3  # quiet: the prior's shapes are measured again (their kernels.json entries are flagged)
    s.rounds = [QUIET]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a re-validation is not a saved kernel missing here
        loaded = RiverForCausalLM.from_pretrained(str(folder), progress=True)
    assert sorted(s.calls) == sorted(key.split(":")[1] for key in SHAPES)
    assert kernels_used(loaded) == {"torch-int4"}
    assert loaded.river_config.kernel_choice == dict.fromkeys(SHAPES, "torch-int4")  # no marks: measured
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "re-validated" in line]
    assert len(lines) == len(SHAPES) and all("came from the prior ranking (AVX-512/AMX: " in line
                                             and line.endswith("quiet machine: torch-int4") for line in lines)

    s.calls.clear()  # a folder saved from the quiet load keeps its measured kernels without measuring
    again = tmp_path / "again"
    loaded.save_pretrained(again)
    assert kernels_used(RiverForCausalLM.from_pretrained(str(again), progress=False)) == {"torch-int4"}
    assert s.calls == []


# -- (d) the prior ranking per feature set -------------------------------------------------------------------


@pytest.mark.parametrize("flags, features, int4, int8", [
    ({"avx2", "avx512f", "amx_tile"}, "AVX-512/AMX", "ark-int4", "torch-dyn-int8"),
    ({"avx2", "avx512f", "avx512_vnni"}, "AVX-512", "river-int4", "torch-int8"),
    ({"avx2", "fma"}, "AVX2", "river-int4", "torch-int8"),
    ({"sse4_2"}, "baseline", "torch-int4", "torch-int8"),
])
def test_the_prior_ranking_per_feature_set(machine, flags, features, int4, int8, scripted_tuner):
    assert prior.features_of(flags) == features
    machine["features"] = features
    for width, expected in (("int4", int4), ("int8", int8)):
        candidates = get_backend(width).candidates
        assert prior.prior_kernel([k.name for k in candidates], features) == expected
        s = scripted_tuner(Script(busy_round(*(k.name for k in candidates))))
        tuner = KernelTuner(False)
        assert tuner.choose(candidates, nn.Linear(256, 128))[0].name == expected
        assert tuner.last_prior.startswith(f"{features}: ") and len(s.calls) == 3
    # a candidate the ranking does not name comes after those it names; none named: the choice's first
    assert prior.prior_kernel(["quanto-int4", "torch-int4-g32"], "AVX-512/AMX") == "quanto-int4"
    assert prior.prior_kernel(["torch-int4-g32", "copy"], features) == "torch-int4-g32"
    assert prior.cpu_features() in prior.PRIOR_RANKING and all(n in KERNELS for r in prior.PRIOR_RANKING.values()
                                                                for n in r)
