"""How many torch calls one exit layer makes per decode step: the architecture's exit copy against
River's fused exit layer (``RiverConfig.exit_layer_impl``), on the same quantized weights.

Counts, no timing. One model (``--model``, fp32 backbone), built twice per ``fuse_projections``
setting (``--fuse``: off, on, or both), with ``exit_layer_impl="architecture"`` and ``"fused"``.
Each reads a short prompt in ``river_mode("exit")`` (every layer its exit copy) and then runs
``--steps`` one-token decode steps; during those steps a forward pre/post hook on one exit layer
(``--layer``) counts, per call of that layer:

- ``torch calls``: calls into torch's Python API (functions and tensor methods, a
  ``TorchFunctionMode``; calls a torch function makes inside itself are not counted again, nor
  tensor property reads such as ``.shape``): what the eager interpreter pays per step;
- ``aten ops``: the operators dispatched to kernels (a ``TorchDispatchMode``: composite operators
  such as ``rms_norm`` count as the operators they decompose into; the cache's ``torch.cat`` and
  the kernels' own ops included).

The first decode step's counts are reported per operator too, and the greedy tokens of the two
implementations are compared (exit mode, ``--steps`` tokens).

    python benchmarks/probes/exit_layer_ops.py --model smollm2-135m --backend torch-int4 --fuse both \\
        --out exit_layer_ops.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a model key, folder or Hub id")
    ap.add_argument("--backend", default="torch-int4", help="exit-layer kernel (one kernel: no measurement)")
    ap.add_argument("--fuse", choices=("off", "on", "both"), default="both", help="fuse_projections settings")
    ap.add_argument("--layer", type=int, default=1, help="the exit layer counted")
    ap.add_argument("--steps", type=int, default=4, help="decode steps counted (and tokens compared)")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--out", default=None, help="JSON file for the counts (default: print only)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoTokenizer

    from river_hf import RiverForCausalLM
    from river_hf.models import resolve
    from river_hf.river import RiverConfig

    class Calls(TorchFunctionMode):
        def __init__(self, names):
            super().__init__()
            self.names = names

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", str(func))
            if name != "__get__":  # a tensor property read (shape, dtype): no call into torch without a mode
                self.names[name] += 1
            return func(*args, **(kwargs or {}))

    class Ops(TorchDispatchMode):
        def __init__(self, names):
            super().__init__()
            self.names = names

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names[str(func)] += 1
            return func(*args, **(kwargs or {}))

    folder = resolve(args.model, progress=False)
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(args.prompt, return_tensors="pt").input_ids
    report = {"model": args.model, "backend": args.backend, "layer": args.layer, "steps": args.steps, "runs": []}
    fuses = {"off": [False], "on": [True], "both": [False, True]}[args.fuse]
    for fuse in fuses:
        tokens = {}
        for impl in ("architecture", "fused"):
            config = RiverConfig(tau=2.0, backend=args.backend, exit_head=None, fuse_projections=fuse,
                                 exit_layer_impl=impl)
            model = RiverForCausalLM.from_pretrained(folder, river_config=config, dtype=torch.float32, progress=False)
            layer = model.model.layers[args.layer].exit_layer
            calls, ops, per_call = collections.Counter(), collections.Counter(), []
            modes = []

            def pre(module, a, k):
                c, o = collections.Counter(), collections.Counter()
                modes.append((Calls(c), Ops(o), c, o))
                modes[-1][0].__enter__()
                modes[-1][1].__enter__()

            def post(module, a, k, out):
                fm, dm, c, o = modes.pop()
                dm.__exit__(None, None, None)
                fm.__exit__(None, None, None)
                per_call.append((sum(c.values()), sum(o.values())))
                if not calls:
                    calls.update(c)
                    ops.update(o)

            with torch.no_grad(), model.river_mode("exit"):
                cache = None
                out = model(input_ids=ids, use_cache=True)
                cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                generated = [int(nxt)]
                handles = [layer.register_forward_pre_hook(pre, with_kwargs=True),
                           layer.register_forward_hook(post, with_kwargs=True)]
                try:
                    for _ in range(args.steps):
                        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                        generated.append(int(nxt))
                finally:
                    for h in handles:
                        h.remove()
            tokens[impl] = generated
            run = {"fuse_projections": fuse, "exit_layer_impl": impl, "exit_layer": type(layer).__name__,
                   "torch_calls_per_step": [c for c, _ in per_call], "aten_ops_per_step": [o for _, o in per_call],
                   "torch_calls": dict(calls.most_common()), "aten_ops": dict(ops.most_common())}
            report["runs"].append(run)
            print(f"fuse_projections={fuse!s:5} {impl:12} ({run['exit_layer']}): torch calls per step "
                  f"{run['torch_calls_per_step']}, aten ops per step {run['aten_ops_per_step']}")
        same = sum(a == b for a, b in zip(tokens["architecture"], tokens["fused"]))
        report.setdefault("token_agreement", {})[str(fuse)] = f"{same}/{len(tokens['fused'])}"
        print(f"fuse_projections={fuse}: greedy exit-mode tokens equal {same}/{len(tokens['fused'])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
