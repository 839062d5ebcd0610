"""A PyTorch decoder of the lab's transformer (lab/model.py), the peer of `lab.serve` where
PyTorch is installed (the `peers` extra): the same shape, the same weights, the same
arithmetic (pre-norm RMSNorm blocks, rotary embeddings, grouped-query attention over a
key/value cache, SwiGLU, an untied or tied head), run eagerly by PyTorch's CPU kernels
(`torch.inference_mode`, its matmuls, `scaled_dot_product_attention` for the prompt and two
matmuls for a decode step's one query, which ran ~16 ms faster per layer than SDPA there; its
own threads), so that decode's
tokens/s can be compared in one process. Float weights only (the int8 path has no PyTorch
counterpart here); every prompt of a batch has the same length (as lab.serve's are).
"""

import dataclasses
import importlib.util
import time

import numpy as np

from lab.config import ModelConfig

DTYPES = ("float32", "bfloat16")  # the compute dtypes the peer runs


def available() -> bool:
    """Whether PyTorch is installed (the `peers` extra)."""
    return importlib.util.find_spec("torch") is not None


def unsupported(cfg: ModelConfig) -> str | None:
    """Why the peer would time another model than `cfg` (what it lacks), or None where it
    decodes the same one."""
    if cfg.softcap or any(cfg.layer_windows):
        return "the PyTorch decoder has no sliding windows or soft-cap"
    if cfg.dtype not in DTYPES:
        return f"the PyTorch decoder computes in {' or '.join(DTYPES)}, not {cfg.dtype}"
    return None


@dataclasses.dataclass
class TorchDecoder:
    """Weights as PyTorch tensors in the compute dtype and a [B, G, S, K] key/value cache."""

    cfg: ModelConfig
    weights: dict
    k_cache: list
    v_cache: list
    length: int = 0

    @classmethod
    def build(cls, cfg: ModelConfig, params, *, batch: int, max_len: int) -> "TorchDecoder":
        """From the lab's unscanned parameters (block_0 … block_{n-1}). Full causal attention
        without a soft-cap, in float32 or bfloat16: any other model is refused (another
        model's time)."""
        import torch

        if why := unsupported(cfg):
            raise ValueError(why)

        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]
        t = lambda a: torch.from_numpy(np.array(a, np.float32)).to(dtype).contiguous()  # noqa: E731
        D, H, G, K = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        w = {"embed": t(params["embed"]), "final_norm": t(params["final_norm"]["scale"])}
        if cfg.tie_embeddings:
            w["head"] = (w["embed"].float().T * D**-0.5).to(dtype).contiguous()
        else:
            w["head"] = t(params["head"])
        for i in range(cfg.n_layers):
            p = params[f"block_{i}"]
            a, m = p["attn"], p["mlp"]
            w[i] = {
                "norm1": t(p["RMSNorm_0"]["scale"]),
                "norm2": t(p["RMSNorm_1"]["scale"]),
                "wq": t(a["wq"]).reshape(D, H * K),
                "wk": t(a["wk"]).reshape(D, G * K),
                "wv": t(a["wv"]).reshape(D, G * K),
                "wo": t(a["wo"]).reshape(H * K, D),
                "w_gate": t(m["w_gate"]),
                "w_up": t(m["w_up"]),
                "w_down": t(m["w_down"]),
            }
        shape = (batch, G, max_len, K)
        k = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.n_layers)]
        v = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.n_layers)]
        return cls(cfg, w, k, v)

    # ------------------------------------------------------------------------ the model

    def _norm(self, x, scale):
        import torch

        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (xf * scale.float()).to(x.dtype)

    def _rope(self, x_BxLxHxK, start: int):
        import torch

        K = x_BxLxHxK.shape[-1]
        freq = self.cfg.rope_theta ** (-torch.arange(0, K, 2, dtype=torch.float32) / K)
        pos = torch.arange(start, start + x_BxLxHxK.shape[1], dtype=torch.float32)
        angle = pos[:, None] * freq  # [L, K/2]
        sin, cos = angle.sin()[None, :, None, :], angle.cos()[None, :, None, :]
        x1, x2 = x_BxLxHxK.float().chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return out.to(x_BxLxHxK.dtype)

    def _forward(self, tokens_BxL):
        """Logits [B, L, V] (float32) of tokens written at slots length … length + L - 1."""
        import torch
        import torch.nn.functional as F

        c, w = self.cfg, self.weights
        B, L = tokens_BxL.shape
        H, G, K = c.n_heads, c.n_kv_heads, c.head_dim
        start, end = self.length, self.length + L
        x = w["embed"][tokens_BxL]
        for i in range(c.n_layers):
            p = w[i]
            h = self._norm(x, p["norm1"])
            q = self._rope((h @ p["wq"]).view(B, L, H, K), start)
            k = self._rope((h @ p["wk"]).view(B, L, G, K), start)
            v = (h @ p["wv"]).view(B, L, G, K)
            self.k_cache[i][:, :, start:end] = k.transpose(1, 2)
            self.v_cache[i][:, :, start:end] = v.transpose(1, 2)
            keys, values = self.k_cache[i][:, :, :end], self.v_cache[i][:, :, :end]
            if L == 1:  # a decode step: two small matmuls (SDPA took ~16 ms per call here)
                q_BxGxRxK = q.view(B, G, H // G, K)
                s_BxGxRxS = (q_BxGxRxK @ keys.transpose(2, 3)).float() * K**-0.5
                p_BxGxRxS = torch.softmax(s_BxGxRxS, dim=-1).to(values.dtype)
                o = (p_BxGxRxS @ values).reshape(B, 1, H * K)
            else:
                o = F.scaled_dot_product_attention(
                    q.transpose(1, 2), keys, values, is_causal=start == 0, enable_gqa=G != H
                )
                o = o.transpose(1, 2).reshape(B, L, H * K)
            x = x + o @ p["wo"]
            h = self._norm(x, p["norm2"])
            x = x + (F.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]
        x = self._norm(x, w["final_norm"])
        self.length = end
        return (x @ w["head"]).float()

    def prefill(self, prompts_BxP):
        """The prompts from an empty cache: the last position's logits [B, V] (numpy)."""
        import torch

        self.length = 0
        with torch.inference_mode():
            return self._forward(torch.from_numpy(np.asarray(prompts_BxP, np.int64)))[:, -1]

    def step(self, tokens_B):
        """One token per sequence at the cache's length: logits [B, V]."""
        import torch

        if self.length >= self.k_cache[0].shape[2]:
            raise ValueError(f"{self.length=}: the cache is full")
        with torch.inference_mode():
            tokens = torch.from_numpy(np.asarray(tokens_B, np.int64))[:, None]
            return self._forward(tokens)[:, 0]


def _time(dec: TorchDecoder, tokens, *, steps: int, budget_s: float) -> list[float]:
    """Samples of `steps` steps (the cache rewound between them) while `budget_s` lasts, at
    least one."""
    start, times = dec.length, []
    begun = time.perf_counter()
    while not times or time.perf_counter() - begun < budget_s:
        t0 = time.perf_counter()
        for _ in range(steps):
            dec.step(tokens)
        times.append((time.perf_counter() - t0) / steps)
        dec.length = start
    return times


def time_decode(cfg: ModelConfig, params, prompts, *, steps: int, budget_s: float) -> dict:
    """Seconds per decode step of the PyTorch decoder after a prefill, as lab.serve times its
    own (samples of `steps` steps, the cache rewound between them), with PyTorch's own thread
    count and with one thread (on a busy host its OpenMP threads wait on each other: ~10 ms
    per small op was seen here); the faster kept: median, tokens/s and the threads it used.

    `budget_s` bounds the timed samples of both thread counts together: each count gets half,
    and where three samples of `steps` steps (at the warm-up's pace) would not fit in it, the
    samples are shorter (`steps` in the result says how many steps each sample took, `samples`
    the fewest samples a thread count got)."""
    import torch

    batch = prompts.shape[0]
    dec = TorchDecoder.build(cfg, params, batch=batch, max_len=prompts.shape[1] + 3 + steps)
    dec.prefill(prompts)
    tokens = prompts[:, -1]
    t0 = time.perf_counter()
    for _ in range(3):
        dec.step(tokens)
    step_s = (time.perf_counter() - t0) / 3  # the warm-up's pace, the first step's cost too
    default = torch.get_num_threads()
    counts = sorted({default, 1}, reverse=True)
    share = budget_s / len(counts)
    fit = max(1, min(steps, int(share / (3 * step_s)) if step_s > 0 else steps))
    medians, samples = {}, []
    try:
        for threads in counts:
            torch.set_num_threads(threads)
            times = _time(dec, tokens, steps=fit, budget_s=share)
            medians[threads] = float(np.median(times))
            samples.append(len(times))
    finally:
        torch.set_num_threads(default)
    threads = min(medians, key=medians.get)
    return {
        "batch": batch,
        "median_s": medians[threads],
        "tokens_per_s": batch / medians[threads],
        "threads": threads,
        "tokens_per_s_by_threads": {t: batch / m for t, m in medians.items()},
        "torch": torch.__version__,
        "steps": fit,
        "samples": min(samples),
    }
