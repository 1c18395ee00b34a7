"""Write llama.cpp's intermediate tensors for a short prompt: the op-level reference of
`tests/quant/test_gguf_llamacpp_numerics.py`.

Run with a Python that has `llama-cpp-python` (not the project venv):

    /work/peer-venv/bin/python scripts/make_llamacpp_op_golden.py

llama.cpp (CPU, flash attention off, F16 KV cache, one batch) evaluates `TOKENS` on the bundled
SmolLM2-135M Q4_1 GGUF with a scheduler eval callback that copies the named graph tensors of
layer 0 (and the first norm of layer 1, the final norm and a slice of the logits) into
`tests/quant/data/smollm2_llamacpp_ops.npz`, float32, shapes in torch order (rows first). Q and K
are in llama.cpp's row order (the GGUF's RoPE-interleaved permutation), as the kernels saw them.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import sys
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "quant" / "data" / "smollm2_llamacpp_ops.npz"
# "The capital of France is Paris. The" and friends: any 8 ids do; these are the ones whose row 3
# exposed torch's inexact scalar / tensor division.
TOKENS = [33580, 14870, 314, 260, 980, 411, 527, 2109]
N_LOGITS = 512  # vocabulary slice kept for the output projection check

# graph tensor name (llama.cpp's cb() names; "#n" = the n-th later tensor of that name) -> key
WANTED = {
    "attn_norm-0": "attn_norm",
    "Qcur-0": "q",
    "Kcur-0": "k",
    "Vcur-0": "v",
    "Qcur-0#1": "q_heads",
    "Qcur-0#2": "q_roped",
    "Kcur-0#1": "k_heads",
    "Kcur-0#2": "k_roped",
    "kq-0": "kq",
    "kq_soft_max-0": "kq_soft_max",
    "kqv_out-0": "kqv_out",
    "attn_out-0": "attn_out",
    "ffn_inp-0": "ffn_inp",
    "ffn_norm-0": "ffn_norm",
    "ffn_gate-0": "ffn_gate",
    "ffn_up-0": "ffn_up",
    "ffn_swiglu-0": "ffn_swiglu",
    "ffn_out-0": "ffn_down",
    "l_out-0": "l_out",
    "attn_norm-1": "attn_norm_1",
    "result_norm": "result_norm",
}


class GGMLTensor(ctypes.Structure):
    """`struct ggml_tensor` of the vendored ggml.h (GGML_MAX_DIMS 4, GGML_MAX_SRC 10)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF path (default: the bundled SmolLM2 Q4_1)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    import llama_cpp

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_llamacpp_golden import find_default_model

    path = Path(args.model) if args.model else find_default_model()

    seen: dict[str, int] = {}
    out: dict[str, np.ndarray] = {}

    def on_tensor(ptr: int, ask: bool, _user: object) -> bool:
        t = GGMLTensor.from_address(ptr)
        name = t.name.decode()
        if ask:
            return name.split("#")[0] in {w.split("#")[0] for w in WANTED}
        n = seen.get(name, 0)
        seen[name] = n + 1
        key = WANTED.get(name if n == 0 else f"{name}#{n}")
        if key is None or t.type != 0 or not t.data:  # F32 tensors only
            return True
        ne, nb = list(t.ne), list(t.nb)
        size = sum((ne[i] - 1) * nb[i] for i in range(4)) + 4
        buf = (ctypes.c_char * size).from_address(t.data)
        arr = np.lib.stride_tricks.as_strided(
            np.frombuffer(buf, dtype=np.float32), shape=ne[::-1], strides=nb[::-1]
        )
        out[key] = arr.squeeze().copy()  # a copy: the graph reuses this memory for later nodes
        return True

    callback = llama_cpp.ggml_backend_sched_eval_callback(on_tensor)
    llm = llama_cpp.Llama(str(path), logits_all=True, n_ctx=512, n_threads=2, verbose=False, flash_attn=False)
    from llama_cpp import _internals

    params = llm.context_params
    params.cb_eval, params.cb_eval_user_data = callback, None
    llm._ctx = _internals.LlamaContext(model=llm._model, params=params, verbose=False)
    llm._batch = _internals.LlamaBatch(n_tokens=llm.n_batch, embd=0, n_seq_max=params.n_ctx, verbose=False)
    llm.reset()
    llm.eval(TOKENS)
    missing = sorted(set(WANTED.values()) - set(out))
    if missing:
        print(f"tensors not seen: {missing}", file=sys.stderr)
        return 1
    n = len(TOKENS)
    # Attention rows: keep the n used KV cells of llama.cpp's padded cache.
    out["kq"] = out["kq"][..., :n]
    out["kq_soft_max"] = out["kq_soft_max"][..., :n]
    out["logits"] = np.array(llm.scores[:n])[:, :N_LOGITS].astype(np.float32)
    out["tokens"] = np.array(TOKENS, dtype=np.int64)
    out["model_sha256"] = np.array(hashlib.sha256(path.read_bytes()).hexdigest())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **out)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes): {', '.join(sorted(out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
