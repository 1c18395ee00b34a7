"""benchmarks/bench_gguf_gpu.py's llamacpp section without a GPU: llama-batched-bench's output parsed
(markdown and JSONL), the section driving a stand-in binary, a failing run recorded rather than
raised, and the table taking the same-run llama.cpp figures over the hard-coded H200 ones."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_gguf_gpu as bg  # noqa: E402

TABLE = """
main: n_kv_max = 16384, n_batch = 2048, n_ubatch = 512, flash_attn = 1, is_pp_shared = 0, n_gpu_layers = 99

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |    128 |    1 |    256 |    0.020 |  6400.00 |    0.500 |   256.00 |    0.520 |   492.31 |
|   128 |    128 |   16 |   4096 |    0.200 | 10240.00 |    1.000 |  2048.00 |    1.200 |  3413.33 |
"""


def test_parse_markdown_table() -> None:
    rows = bg.parse_batched_bench(TABLE)
    assert [r["pl"] for r in rows] == [1, 16]
    assert rows[1] == {"pp": 128, "tg": 128, "pl": 16, "n_kv": 4096, "t_pp": 0.2, "speed_pp": 10240.0,
                       "t_tg": 1.0, "speed_tg": 2048.0, "t": 1.2, "speed": 3413.33}  # fmt: skip


def test_parse_jsonl() -> None:
    line = ('{"n_kv_max": 2048, "n_batch": 2048, "n_ubatch": 512, "flash_attn": 1, "is_pp_shared": 0, "pp": 128, '
            '"tg": 128, "pl": 2, "n_kv": 512, "t_pp": 0.42, "speed_pp": 605.7, "t_tg": 11.1, "speed_tg": 23.05, '
            '"t": 11.5, "speed": 44.4}')  # fmt: skip
    assert bg.parse_batched_bench("log line\n" + line)[0]["speed_tg"] == 23.05


FAKE = """\
#!{python}
import sys
args = sys.argv[1:]
opt = lambda name: args[args.index(name) + 1]
if "{fail}" in opt("-m"):
    print("llama_model_load: error loading model", file=sys.stderr)
    sys.exit(1)
print("build: 0 (0c1e57098) with cc", file=sys.stderr)
print("|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |")
print("|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|")
for pl in map(int, opt("-npl").split(",")):
    pp, tg = int(opt("-npp")), int(opt("-ntg"))
    print(f"| {{pp}} | {{tg}} | {{pl}} | {{pl * (pp + tg)}} | 0.1 | {{pp * pl * 10.0}} | 1.0 | {{100.0 * pl}} | 1.1 | 1.0 |")
"""


def _fake_bench(tmp_path: Path, fail: str = "never") -> SimpleNamespace:
    binary = tmp_path / "llama-batched-bench"
    binary.write_text(textwrap.dedent(FAKE).format(python=sys.executable, fail=fail))
    binary.chmod(0o755)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "COMMIT").write_text("0c1e57098\n")
    files = {}
    for mix in ("q4_k_m", "q8_0"):
        files[mix] = tmp_path / f"{mix}.gguf"
        files[mix].write_bytes(b"")
    args = argparse.Namespace(
        llamacpp_bin=str(binary), llamacpp_src=str(tmp_path / "src"), llamacpp_commit=None, llamacpp_npl="1,16,64",
        llamacpp_fa="on", llamacpp_timeout=60.0, q4km=str(files["q4_k_m"]), q8=str(files["q8_0"]),
    )  # fmt: skip
    return SimpleNamespace(args=args, tmp=tmp_path, results={})


def test_section_runs_the_binary_on_both_files(tmp_path: Path) -> None:
    bench = _fake_bench(tmp_path)
    out = bg.section_llamacpp(bench)
    assert out["commit"] == "0c1e57098"
    for mix in ("q4_k_m", "q8_0"):
        r = out[mix]
        assert "error" not in r
        assert r["tg_tok_s"] == {"1": 100.0, "16": 1600.0, "64": 6400.0}
        assert r["pp512_tok_s"] == 5120.0
        cmd = r["decode"]["command"]
        assert f"-m {tmp_path / (mix + '.gguf')}" in cmd and "-npl 1,16,64" in cmd and "-c 16384" in cmd
        assert "-ngl 99" in cmd and "-fa on" in cmd
        assert any(line.startswith("build:") for line in r["decode"]["info"])


def test_failed_run_is_recorded(tmp_path: Path) -> None:
    out = bg.section_llamacpp(_fake_bench(tmp_path, fail="q8_0"))
    assert "error" not in out["q4_k_m"]
    assert out["q8_0"]["error"] == "decode run: exit code 1"
    assert "error loading model" in out["q8_0"]["decode"]["stderr_tail"]
    assert out["q8_0"]["tg_tok_s"] == {}


def test_missing_binary_raises_for_run_sections(tmp_path: Path) -> None:
    bench = _fake_bench(tmp_path)
    bench.args.llamacpp_bin = str(tmp_path / "absent")
    with pytest.raises(FileNotFoundError):
        bg.section_llamacpp(bench)


def _engine(b1: float, b16: float) -> dict:
    return {"batch1": {"tok_s": b1, "GBps": 1000.0, "frac_copy_bw": 0.5}, "batch16": {"tok_s": b16},
            "pp512": {"tok_s": 9000.0}, "memory": {}}  # fmt: skip


def test_table_prefers_same_run_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = {"q4_k_m": _engine(250.0, 2000.0), "q8_0": _engine(200.0, 1900.0), "device": "NVIDIA H100"}
    bg.print_table(results)
    assert "(H200)" in capsys.readouterr().out
    results["llamacpp"] = bg.section_llamacpp(_fake_bench(tmp_path))
    ref, same = bg.llamacpp_reference(results, "q4_k_m")
    assert same and ref["tg128"] == 100.0 and ref["b16"] == 1600.0
    assert bg.llamacpp_reference(results, "bf16") == (bg.LLAMACPP["bf16"], False)
    ratios = bg.same_run_ratios(results)
    assert ratios["q4_k_m"]["batch1"] == pytest.approx(2.5)
    assert ratios["q8_0"]["batch16"] == pytest.approx(1900.0 / 1600.0)
    bg.print_table(results)
    text = capsys.readouterr().out
    assert "1.25 (same run)" in text and "(H200)" not in text
