"""CLI flag parsing: spellings, defaults, 32k/32K, aliases, YAML config, ConfigError -> exit 2."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from paphos import cli
from paphos.config import ConfigError


def _configs(*argv: str):
    return cli.build_configs(cli.parse_args(["run", "m.gguf", *argv]))


def test_defaults():
    engine, server = _configs()
    assert (server.host, server.port, server.uvicorn_log_level) == ("127.0.0.1", 2242, "info")
    assert not server.disable_log_requests and not server.return_tokens_as_token_ids
    m, c, s = engine.model, engine.cache, engine.scheduler
    assert m.model == "m.gguf" and m.served_names == ("m.gguf",) and m.max_model_len is None
    assert (m.dtype, m.load_format, m.seed, m.max_logprobs, m.device) == ("auto", "auto", 0, 20, "auto")
    assert not m.enforce_eager and m.chat_template is None
    assert (c.block_size, c.enable_prefix_caching, c.gpu_memory_utilization, c.kv_cache_dtype) == (16, True, 0.92, "auto")
    assert c.cpu_kv_cache_gb == 4.0
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.enable_chunked_prefill) == (256, None, True)


def test_serve_alias_and_model_flag():
    assert cli.parse_args(["serve", "x"]).model_positional == "x"
    engine, _ = cli.build_configs(cli.parse_args(["serve", "--model", "y"]))
    assert engine.model.model == "y"
    # The positional wins over --model.
    engine, _ = cli.build_configs(cli.parse_args(["run", "pos", "--model", "flag"]))
    assert engine.model.model == "pos"


@pytest.mark.parametrize(("text", "value"), [("32k", 32000), ("32K", 32768), ("4096", 4096), ("-1", None),
                                             ("auto", None), ("1.5k", 1500), ("2M", 2 * 1024 * 1024)])
def test_max_model_len_spellings(text, value):
    engine, _ = _configs("--max-model-len", text)
    assert engine.model.max_model_len == value


def test_bad_max_model_len_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["run", "--max-model-len", "lots"])
    assert exc.value.code == 2
    assert "--max-model-len" in capsys.readouterr().err


def test_dash_and_underscore_spellings():
    a = cli.parse_args(["run", "--max-model-len", "1k", "--gpu-memory-utilization", "0.5", "--max-num-seqs", "3",
                        "--served-model-name", "a", "b", "--disable-log-requests", "--cpu-kv-cache-gb", "2"])
    b = cli.parse_args(["run", "--max_model_len", "1k", "--gpu_memory_utilization", "0.5", "--max_num_seqs", "3",
                        "--served_model_name", "a", "b", "--disable_log_requests", "--cpu_kv_cache_gb", "2"])
    assert vars(a) == vars(b)
    assert cli.parse_args(["run", "-gmu", "0.7"]).gpu_memory_utilization == 0.7


def test_prefix_caching_flags():
    assert _configs("--no-enable-prefix-caching")[0].cache.enable_prefix_caching is False
    assert _configs("--no_enable_prefix_caching")[0].cache.enable_prefix_caching is False
    assert _configs("--context-shift")[0].cache.enable_prefix_caching is True
    assert _configs("--enable-prefix-caching", "false")[0].cache.enable_prefix_caching is False


def test_chunked_prefill_flag():
    engine, _ = _configs("--enable-chunked-prefill", "false", "--max-model-len", "8k")
    assert engine.scheduler.enable_chunked_prefill is False
    assert engine.scheduler.max_num_batched_tokens == 8000
    assert _configs("--enable-chunked-prefill")[0].scheduler.enable_chunked_prefill is True


def test_other_flags():
    engine, server = _configs(
        "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "a", "b", "--tokenizer", "tok",
        "--dtype", "float16", "--max-num-batched-tokens", "512", "--block-size", "32", "--kv-cache-dtype", "fp8",
        "--load-format", "gguf", "--seed", "5", "--max-logprobs", "10", "--return-tokens-as-token-ids",
        "--device", "cpu", "--enforce-eager", "--uvicorn-log-level", "debug", "--chat-template", "{{ x }}",
    )
    m = engine.model
    assert (server.host, server.port, server.uvicorn_log_level, server.return_tokens_as_token_ids) == ("0.0.0.0", 8000, "debug", True)
    assert m.served_names == ("a", "b") and m.tokenizer == "tok" and m.dtype == "float16"
    assert (m.load_format, m.seed, m.max_logprobs, m.device, m.enforce_eager) == ("gguf", 5, 10, "cpu", True)
    assert m.chat_template == "{{ x }}"
    assert engine.scheduler.max_num_batched_tokens == 512 and engine.cache.block_size == 32
    assert engine.cache.kv_cache_dtype == "fp8"


def test_chat_template_file(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert _configs("--chat-template", str(path))[0].model.chat_template == "{{ messages }}"


def test_yaml_config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("port: 9000\nmax-model-len: 2k\nmodel: from-yaml\nenable_prefix_caching: false\n"
                    "served_model_name: one\ngmu: 0.5\n")
    engine, server = cli.build_configs(cli.parse_args(["run", "--config", str(path), "--port", "9001"]))
    assert server.port == 9001  # the explicit flag wins
    assert engine.model.max_model_len == 2000 and engine.model.model == "from-yaml"
    assert engine.cache.enable_prefix_caching is False and engine.model.served_names == ("one",)
    assert engine.cache.gpu_memory_utilization == 0.5


def test_yaml_unknown_key_exits_2(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("nonsense: 1\n")
    assert cli.main(["run", "--config", str(path)]) == 2
    assert "nonsense" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "flag"), [
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--block-size", "3"], "--block-size"),
    (["--dtype", "float8"], "--dtype"),
    (["--port", "0"], "--port"),
    (["--max-model-len", "0"], "--max-model-len"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
])
def test_config_errors_exit_2(argv, flag, capsys):
    assert cli.main(["run", "m", *argv]) == 2
    assert flag in capsys.readouterr().err


def test_help_documents_flags():
    out = subprocess.run([sys.executable, "-m", "paphos", "run", "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("--host", "0.0.0.0", "--port", "--max-model-len", "32k", "--context-shift", "--no-enable-prefix-caching",
                 "--enable-chunked-prefill", "-gmu", "--cpu-kv-cache-gb", "--served-model-name", "--config"):
        assert flag in out
    assert "--max_model_len LEN" not in out  # each flag listed once, dashed


def test_model_that_fails_to_load_exits_1(tmp_path):
    missing = tmp_path / "missing.gguf"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "paphos", "run", str(missing), "--port", str(port), "--device", "cpu"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "failed to load" in proc.stderr


def test_bundled_default_model_is_served_under_a_stable_name(monkeypatch):
    import paphos.default_model

    monkeypatch.setattr(paphos.default_model, "default_model_path", lambda: "/cache/SmolLM2.gguf")
    engine, _ = cli.build_configs(cli.parse_args(["run"]))
    assert engine.model.model == "/cache/SmolLM2.gguf"
    assert engine.model.served_names == ("SmolLM2-135M-Instruct",)
    engine, _ = cli.build_configs(cli.parse_args(["run", "--served-model-name", "mine"]))
    assert engine.model.served_names == ("mine",)


def test_server_flags():
    _, server = _configs()
    assert server.api_keys == () and server.admin_key is None
    assert (server.allowed_origins, server.allowed_methods, server.allowed_headers) == (("*",), ("*",), ("*",))
    assert not server.allow_credentials and not server.disable_log_stats and server.max_log_len is None
    assert server.kobold_default_max_length == 200
    engine, server = _configs(
        "--served-model-name", "a", "b", "--allowed-origins", '["https://a.example"]', "--allowed_methods",
        '["GET","POST"]', "--allow-credentials", "--disable-log-stats", "--max-log-len", "80",
        "--launch-kobold-api", "--kobold-default-max-length", "512", "--root-path", "/paphos",
        "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--disable-fastapi-docs",
    )
    assert engine.model.served_names == ("a", "b")
    assert server.allowed_origins == ("https://a.example",) and server.allowed_methods == ("GET", "POST")
    assert server.allow_credentials and server.disable_log_stats and server.max_log_len == 80
    assert server.kobold_default_max_length == 512
    assert (server.root_path, server.ssl_keyfile, server.ssl_certfile, server.ssl_cert_reqs) == ("/paphos", "k.pem", "c.pem", 0)
    assert server.disable_fastapi_docs and not _configs()[1].disable_fastapi_docs


def test_bad_cors_json_exits_2():
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["run", "m.gguf", "--allowed-origins", "https://a.example"])
    assert exc.value.code == 2


def test_yaml_auth_flags(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text('api_keys: k1\nallowed_origins: \'["https://x.example"]\'\nadmin-key: adm\n')
    _, server = cli.build_configs(cli.parse_args(["run", "m.gguf", "--config", str(path)]))
    assert server.api_keys == ("k1",) and server.allowed_origins == ("https://x.example",) and server.admin_key == "adm"


def test_version_has_one_source():
    """`paphos --version`, GET /version and the package metadata all come from paphos/version.py."""
    import tomllib
    from pathlib import Path

    from starlette.testclient import TestClient

    from paphos.version import __version__
    from tests.server.fakes import FakeEngine, make_app

    out = subprocess.run([sys.executable, "-m", "paphos", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"paphos {__version__}"
    with TestClient(make_app(FakeEngine())) as client:
        assert client.get("/version").json() == {"version": __version__}
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "paphos.version.__version__"}


def test_threads_flag():
    assert _configs("--threads", "3")[0].model.threads == 3
    assert _configs()[0].model.threads is None  # torch's default: one per physical core
    with pytest.raises(ConfigError, match="--threads must be >= 1"):
        _configs("--threads", "0")


def test_lora_flags_take_aphrodites_names_and_both_module_forms(tmp_path):
    engine, _ = _configs(
        "--enable-lora", "--max-loras", "4", "--max-lora-rank", "64", "--max-cpu-loras", "8", "--lora-dtype", "bfloat16",
        "--lora-modules", "support=/a/support", '{"name": "legal", "path": "org/legal", "base_model_name": "base"}',
        "--lora-modules", "third=/a/third",
    )
    lora = engine.lora
    assert (lora.enable_lora, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras, lora.lora_dtype) == (
        True, 4, 64, 8, "bfloat16")
    assert [(m.name, m.path, m.base_model_name) for m in lora.lora_modules] == [
        ("support", "/a/support", None), ("legal", "org/legal", "base"), ("third", "/a/third", None)]
    defaults = _configs()[0].lora
    assert not defaults.enable_lora and (defaults.max_loras, defaults.max_lora_rank, defaults.cpu_capacity) == (1, 16, 1)
    path = tmp_path / "c.yaml"
    path.write_text("enable-lora: true\nlora-modules: one=/x\n")
    assert [m.name for m in cli.build_configs(cli.parse_args(["run", "--config", str(path)]))[0].lora.lora_modules] == ["one"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--enable-lora", "--max-lora-rank", "24"], "--max-lora-rank must be one of"),
    (["--enable-lora", "--max-loras", "0"], "--max-loras must be >= 1"),
    (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "--max-cpu-loras (2) must be >= --max-loras (4)"),
    (["--enable-lora", "--fully-sharded-loras"], "--fully-sharded-loras is not supported"),
    (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "a"], "expected name=path or a JSON object"),
    (["--enable-lora", "--lora-modules", '{"name": "a"}'], "needs string fields name and path"),
    (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "the name 'a' is given twice"),
])
def test_bad_lora_flags_exit_2_naming_the_flag(argv, message, capsys):
    assert cli.main(["run", "m", *argv]) == 2
    assert message in capsys.readouterr().err


def test_tensor_parallel_flag(capsys):
    assert _configs("-tp", "2")[0].parallel.tensor_parallel_size == 2
    assert _configs("--tensor_parallel_size", "4")[0].parallel.tensor_parallel_size == 4
    assert _configs()[0].parallel.tensor_parallel_size == 1
    assert cli.main(["run", "m", "-tp", "0"]) == 2
    assert "--tensor-parallel-size must be >= 1" in capsys.readouterr().err
    # LoRA slices per rank (docs/lora.md): the flags combine.
    assert _configs("-tp", "2", "--enable-lora")[0].lora.enable_lora
