"""Is a batched prefill on MLX-CUDA bound by its quantized matmuls? (issue #19: at 16 streams a step that
prefilled 8 prompts of ~175 tokens took 90-190 ms on an H100 for the 0.6B shape.)
1. one projection at M rows: `quantized_matmul` as the layer runs it, against dequantizing the weight and a
   plain matmul (cuBLAS), for three projections of the first layer;
2. a whole prefill forward (8 prompts x 176 tokens, one of 1,408, one of 4,096) with the layers as loaded, against
   the same with every quantized linear taking the dequantize path at >= 128 rows; the largest logit difference.
usage: python3 scripts/cuda_prefill_probe.py MODEL_DIR"""
import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from cuda_qmm_probe import ms  # this folder's qmm probe: median ms of an evaluated call after 2 untimed


def dequant_matmul(layer, x):
    w = mx.dequantize(layer.weight, layer.scales, layer.get("biases"), layer.group_size, layer.bits,
                      getattr(layer, "mode", "affine"))
    y = x @ w.T
    return y + layer["bias"] if "bias" in layer else y


class Dequant(nn.Module):
    def __init__(self, inner, at):
        super().__init__()
        self.inner, self.at = inner, at

    def __call__(self, x):
        rows = x.size // x.shape[-1]
        return dequant_matmul(self.inner, x) if rows >= self.at else self.inner(x)


def projections(model):
    layer = model.model.layers[0]
    for name, proj in (("q_proj", layer.self_attn.q_proj), ("gate_proj", layer.mlp.gate_proj),
                       ("down_proj", layer.mlp.down_proj)):
        k = proj.weight.shape[1] * 32 // proj.bits
        for m in (16, 64, 128, 256, 512, 1408, 4096):
            x = mx.random.normal((m, k)).astype(mx.bfloat16)
            q = ms(lambda: proj(x))
            d = ms(lambda: dequant_matmul(proj, x))
            print(f"{name} K={k} N={proj.weight.shape[0]} M={m}: qmm {q:.3f} ms  dequant+matmul {d:.3f} ms "
                  f"({q / d:.2f}x)", flush=True)


def prefill(model, rows, length):
    mx.random.seed(0)
    tokens = mx.random.randint(0, 1000, (rows, length))

    def run():
        cache = make_prompt_cache(model)
        return model(tokens, cache=cache)[:, -1]

    return ms(run, repeats=5), run()


def main():
    model, _ = load(sys.argv[1])
    print("mlx", mx.__version__, mx.default_device())
    projections(model)
    shapes = [(8, 176), (1, 1408), (1, 4096)]
    before = {s: prefill(model, *s) for s in shapes}
    swapped = []
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for key, child in parent.children().items():
                if isinstance(child, nn.QuantizedLinear):
                    setattr(parent, key, Dequant(child, 128))
                    swapped.append(key)
    print("swapped", len(swapped), "layers", flush=True)
    after = {s: prefill(model, *s) for s in shapes}
    for s in shapes:
        diff = mx.abs(before[s][1].astype(mx.float32) - after[s][1].astype(mx.float32)).max().item()
        print(f"prefill {s[0]} x {s[1]}: {before[s][0]:.2f} ms -> {after[s][0]:.2f} ms with dequant "
              f"({before[s][0] / after[s][0]:.2f}x), max logit diff {diff:.4f}", flush=True)


if __name__ == "__main__":
    main()
