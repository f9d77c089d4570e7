"""River on a GPU: exactness and speed bounds on a random-weight model of a real shape.

    python benchmarks/probes/gpu_river.py [--shape qwen2.5-0.5b|qwen2.5-1.5b] [--new-tokens 128] [--out FILE.json]

No checkpoint travels to the GPU machine, so the weights are random: the exit *decisions* mean
nothing here, but the speed of the unmodified model (river_mode "backbone"), of the fully 4-bit
model (river_mode "exit", every layer on its exit copy) and of a fixed exit layer bound what
River can gain on this GPU; τ > 1 must still be token-identical to the unmodified model.
"""

from __future__ import annotations

import argparse
import json
import time

SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=20001, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=SHAPES)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from river_hf import enable_river
    from river_hf.river import ExitRuleList, MinLayerRule, StateTransitionSimilarityRule

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[args.shape], max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    model.generation_config.pad_token_id = 0
    ids = torch.randint(100, 20000, (1, 64), device=device)
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    ref = model.generate(ids, **gen)

    t0 = time.perf_counter()
    enable_river(model, tau=2.0, progress=False)
    build_s = time.perf_counter() - t0
    exact = bool(torch.equal(model.generate(ids, **gen), ref))

    def timed(label):
        rates, bws = [], []
        for _ in range(args.repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            model.generate(ids, **gen)
            rates.append(model.river_stats["tokens_per_s"])
            bws.append(model.river_stats.get("bandwidth_gb_s"))
        rates.sort()
        row = {"label": label, "tokens_per_s": rates[len(rates) // 2], "bandwidth_gb_s": sorted(bws)[len(bws) // 2],
               "mean_exit_layer": model.river_stats["mean_exit_layer"]}
        print(f"{label}: {row['tokens_per_s']:.1f} tokens/s, {row['bandwidth_gb_s']:.0f} GB/s, "
              f"mean exit layer {row['mean_exit_layer']}", flush=True)
        return row

    rows = []
    with model.river_mode("backbone"):
        timed("warm-up")
        rows.append(timed("unmodified"))
    with model.river_mode("exit"):
        rows.append(timed("fully 4-bit"))
    L = config.num_hidden_layers
    for k in (L // 4, L // 2):
        model.river.rules = ExitRuleList([MinLayerRule(k), StateTransitionSimilarityRule(-2.0)])
        rows.append(timed(f"exit at layer {k}"))
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "shape": args.shape, "dtype": str(dtype), "new_tokens": args.new_tokens,
              "exit_layer_build_seconds": build_s, "tau_above_one_token_identical": exact, "rows": rows}
    print(json.dumps(result, indent=2))
    if args.out:
        from river_hf.eval.common import write_json

        write_json(args.out, result)

if __name__ == "__main__":
    main()
