"""`paphos run|serve [MODEL] [flags]`: command line -> validated configs -> engine + HTTP server.

The edge of the system (design.md §2): flags (Aphrodite's names, contract §1), optionally a flat
YAML file (`--config`, explicit flags win), become EngineConfig/ServerConfig; a ConfigError exits
with status 2 and a message naming the flag. Then an AsyncEngine (not yet loaded) and the FastAPI
app are built and uvicorn serves; the model loads in the background while /health says 503.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from paphos.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    GGUF_NUMERICS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    LORA_DTYPES,
    LORA_RANKS,
    QUANTIZATIONS,
    CacheConfig,
    ConfigError,
    EngineConfig,
    LoRAConfig,
    LoRAModule,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServerConfig,
)
from paphos.version import __version__

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# Contract §1.2: the env var gives the key only when --api-keys is absent; --admin-key wins over its.
API_KEY_ENV = "APHRODITE_API_KEY"
ADMIN_KEY_ENV = "APHRODITE_ADMIN_KEY"
# Flags taking several values: a YAML file may give one as a plain string.
_LIST_DESTS = frozenset({"served_model_name", "api_keys", "lora_modules"})
_SUFFIXES = {"k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}


def parse_max_model_len(value: str | int | None) -> int | None:
    """`32k` = 32000, `32K` = 32768, `-1` / `auto` = let the engine choose (None)."""
    if value is None or isinstance(value, int):
        return None if value in (None, -1) else value
    text = value.strip()
    if text.lower() == "auto" or text == "-1":
        return None
    factor = 1
    if text and text[-1] in _SUFFIXES:
        factor, text = _SUFFIXES[text[-1]], text[:-1]
    try:
        number = float(text) * factor
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a length like 4096, 32k, 32K, -1 or auto, got {value!r}") from None
    if not number.is_integer():
        raise argparse.ArgumentTypeError(f"expected a whole number of tokens, got {value!r}")
    return int(number)


def parse_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    text = value.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def parse_json_list(value: str) -> list[str]:
    """CORS flags take a JSON list (`'["https://a.example"]'`), as Aphrodite's do."""
    try:
        items = json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}") from None
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
    return items


def _spellings(*flags: str) -> list[str]:
    """Every long flag also under its underscore spelling (contract §1.1: `-` or `_`)."""
    names: list[str] = []
    for flag in flags:
        names.append(flag)
        if flag.startswith("--") and "-" in flag[2:]:
            names.append("--" + flag[2:].replace("-", "_"))
    return names


class _HelpFormatter(argparse.HelpFormatter):
    """Lists each flag once, in its dashed spelling (the underscore twins still parse)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        shown = [o for o in action.option_strings if "_" not in o]
        saved = action.option_strings
        action.option_strings = shown or saved
        try:
            return super()._format_action_invocation(action)
        finally:
            action.option_strings = saved


def _add(group: Any, *flags: str, **kwargs: Any) -> None:
    group.add_argument(*_spellings(*flags), **kwargs)


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_positional", nargs="?", metavar="MODEL", help="model to serve (overrides --model); "
                        "default: the bundled SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--config", metavar="FILE.yaml", help="flat YAML map of flags (`port: 2242`); explicit flags win")
    srv = parser.add_argument_group("server")
    _add(srv, "--host", default="127.0.0.1",
         help="address to bind (default 127.0.0.1: this machine only; --host 0.0.0.0 exposes the server on every "
              "network interface - a deliberate difference from Aphrodite)")
    _add(srv, "--port", type=int, default=2242, help="port (default 2242, as Aphrodite)")
    _add(srv, "--served-model-name", nargs="+", metavar="NAME",
         help="names accepted in `model`; the first is echoed in responses (default: the model path)")
    _add(srv, "--uvicorn-log-level", default="info", choices=LOG_LEVELS, help="uvicorn log level (default info)")
    _add(srv, "--disable-log-requests", action="store_true", help="do not log each request")
    _add(srv, "--max-num-waiting", type=int, default=1024, metavar="N",
         help="requests admitted but not yet started, at most; more get 429 with Retry-After (default 1024, "
              "-1: no bound)")
    _add(srv, "--request-timeout", type=float, default=None, metavar="S",
         help="seconds from a request's arrival to its last token, queue included; past it the request is "
              "aborted (504, or an error event once streaming) (default: no limit)")
    _add(srv, "--shutdown-timeout", type=float, default=5.0, metavar="S",
         help="on SIGTERM / Ctrl-C, seconds in-flight requests get to finish before they are aborted; new "
              "connections are refused at once (default 5)")
    _add(srv, "--return-tokens-as-token-ids", action="store_true",
         help="spell logprob tokens as `token_id:N` (for tokens that are not valid text)")
    _add(srv, "--disable-log-stats", action="store_true", help="no stats line (tokens/s, requests, KV use) every 10 s")
    _add(srv, "--max-log-len", type=int, default=None, metavar="N",
         help="prompt characters or token ids shown per logged request (default: all)")
    _add(srv, "--launch-kobold-api", action="store_true",
         help="accepted for compatibility: the KoboldAI API is always served under /api")
    _add(srv, "--kobold-default-max-length", type=int, default=200, metavar="N",
         help="Kobold `max_length` when a request gives none, and /api/v1/config/max_length (default 200)")
    _add(srv, "--ssl-keyfile", metavar="FILE", help="TLS private key (serve HTTPS with --ssl-certfile)")
    _add(srv, "--ssl-certfile", metavar="FILE", help="TLS certificate")
    _add(srv, "--ssl-ca-certs", metavar="FILE", help="CA certificates for client certificates")
    _add(srv, "--ssl-cert-reqs", type=int, default=0, metavar="N",
         help="client certificate requirement (Python ssl.CERT_*: 0 none, 1 optional, 2 required; default 0)")
    _add(srv, "--root-path", default="", metavar="PATH",
         help="path prefix the server is mounted under behind a reverse proxy (e.g. /paphos)")
    _add(srv, "--disable-fastapi-docs", action="store_true", help="do not serve /docs, /redoc and /openapi.json")
    _add(srv, "--disable-web-ui", action="store_true", help="do not serve the web page (chat and story modes) at /")
    auth = parser.add_argument_group("auth and CORS")
    _add(auth, "--api-keys", "--api-key", dest="api_keys", nargs="+", metavar="KEY",
         help=f"keys accepted as `Authorization: Bearer KEY` or `X-API-Key: KEY` on /v1 and /api (default: "
              f"${API_KEY_ENV} if set, else no auth)")
    _add(auth, "--admin-key", metavar="KEY",
         help=f"key for admin routes (adapter/model management), which are closed without one (default: "
              f"${ADMIN_KEY_ENV})")
    _add(auth, "--allowed-origins", type=parse_json_list, default=["*"], metavar="JSON",
         help='CORS origins as a JSON list (default ["*"])')
    _add(auth, "--allowed-methods", type=parse_json_list, default=["*"], metavar="JSON",
         help='CORS methods as a JSON list (default ["*"])')
    _add(auth, "--allowed-headers", type=parse_json_list, default=["*"], metavar="JSON",
         help='CORS headers as a JSON list (default ["*"])')
    _add(auth, "--allow-credentials", action="store_true", help="CORS: allow credentials")
    mdl = parser.add_argument_group("model")
    _add(mdl, "--model", help="HF-style directory, .gguf file (or first shard), or a Hugging Face repo id: "
         "org/name, org/name:Q4_K_M (the GGUF file with that quant tag) or org/name/FILE.gguf")
    _add(mdl, "--tokenizer", help="tokenizer location, a path or repo id like --model (default: the model's)")
    _add(mdl, "--revision", metavar="REV", help="branch, tag or commit of a repo-id model (default: main)")
    _add(mdl, "--tokenizer-revision", metavar="REV", help="branch, tag or commit of a repo-id --tokenizer")
    _add(mdl, "--download-dir", metavar="DIR",
         help="Hugging Face cache to download repo-id models into (default: $HF_HUB_CACHE, ~/.cache/huggingface/hub); "
              "HF_TOKEN authenticates, HF_HUB_OFFLINE=1 uses the cache only")
    _add(mdl, "--dtype", default="auto", help=f"weight/activation dtype: {', '.join(DTYPES)} (default auto)")
    _add(mdl, "--max-model-len", type=parse_max_model_len, default=None, metavar="LEN",
         help="context length: 4096, 32k (=32000), 32K (=32768), -1 or auto (default: from the model config)")
    _add(mdl, "--load-format", default="auto", help=f"{', '.join(LOAD_FORMATS)} (default auto)")
    _add(mdl, "--seed", type=int, default=0, help="global seed (default 0)")
    _add(mdl, "--max-logprobs", type=int, default=20, help="largest logprobs / top_logprobs a request may ask (default 20)")
    _add(mdl, "--device", default="auto", help="cuda, cpu or auto (default auto: cuda when available)")
    _add(mdl, "--chat-template", metavar="TEMPLATE",
         help="Jinja chat template, or a path to a file holding one (default: the tokenizer's)")
    _add(mdl, "--enforce-eager", action="store_true",
         help="run every step eagerly: no CUDA graphs on a GPU, no compiled decode step on the CPU")
    _add(mdl, "--threads", type=int, default=None, metavar="N",
         help="CPU threads for the model's matmuls and kernels (default: one per physical core)")
    _add(mdl, "--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
         help="paged attention kernels: triton, torch (the reference) or auto (default: triton on a GPU)")
    _add(mdl, "--quantization", "-q", default=None, metavar="METHOD",
         help=f"weight quantization: {', '.join(QUANTIZATIONS)} (default: from the model; gguf for a .gguf file)")
    _add(mdl, "--gguf-numerics", choices=GGUF_NUMERICS, default="float",
         help="matmuls with quantized GGUF weights: float (float32 activations, the accurate result; "
              "default) or llamacpp (round activations to 8 bits as llama.cpp's CPU backend does)")
    par = parser.add_argument_group("parallelism")
    _add(par, "--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
         help="split the model over N GPUs of this machine (N processes; gloo over CPU processes with "
              "--device cpu); N must divide the attention heads (default 1); docs/tensor-parallel.md")
    cache = parser.add_argument_group("KV cache")
    _add(cache, "--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    _add(cache, "--enable-prefix-caching", "--context-shift", dest="enable_prefix_caching", type=parse_bool,
         nargs="?", const=True, default=True, metavar="BOOL",
         help="reuse KV blocks of identical prompt prefixes (default on; --context-shift is a deprecated alias)")
    _add(cache, "--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
         help="turn prefix caching off")
    _add(cache, "--gpu-memory-utilization", "-gmu", type=float, default=0.92, metavar="FRACTION",
         help="fraction of GPU memory for weights, activations and KV cache (default 0.92)")
    _add(cache, "--kv-cache-dtype", default="auto", help=f"{', '.join(KV_CACHE_DTYPES)} (default auto)")
    _add(cache, "--cpu-kv-cache-gb", type=float, default=4.0, metavar="GIB",
         help="KV cache budget in GiB when running on CPU (default 4)")
    _add(cache, "--num-gpu-blocks-override", type=int, default=None, metavar="N",
         help="force the number of KV blocks (tests, benchmarks)")
    sched = parser.add_argument_group("scheduler")
    _add(sched, "--max-num-seqs", type=int, default=256, help="sequences per step (default 256)")
    _add(sched, "--decode-lookahead", action=argparse.BooleanOptionalAction, default=None,
         help="launch the next decode step before the current one is read back (default: on where decode "
              "steps replay CUDA graphs)")
    _add(sched, "--max-num-batched-tokens", type=int, default=None, metavar="N",
         help="tokens per step (default with chunked prefill: 8192 on a GPU, 2048 on the CPU; "
              "without: max(max-model-len, 2048))")
    _add(sched, "--enable-chunked-prefill", type=parse_bool, nargs="?", const=True, default=True, metavar="BOOL",
         help="split long prompts over several steps (default true)")
    lora = parser.add_argument_group("LoRA adapters")
    _add(lora, "--enable-lora", action="store_true",
         help="serve LoRA adapters, chosen per request by `model` (Kobold: `lora`)")
    _add(lora, "--lora-modules", nargs="+", action="extend", metavar="NAME=PATH",
         help='adapters to load at start: name=path or JSON {"name": ..., "path": ..., "base_model_name": ...}; '
              "a path may be a PEFT directory or a Hugging Face repo id")
    _add(lora, "--max-loras", type=int, default=1, metavar="N",
         help="adapters resident on the device at once: the most distinct adapters in one step (default 1)")
    _add(lora, "--max-lora-rank", type=int, default=16, metavar="R",
         help=f"largest adapter rank accepted: {', '.join(map(str, LORA_RANKS))} (default 16)")
    _add(lora, "--max-cpu-loras", type=int, default=None, metavar="N",
         help="adapters kept in host memory, least recently used evicted (default: --max-loras)")
    _add(lora, "--lora-dtype", default="auto", choices=LORA_DTYPES,
         help="dtype of adapter weights (default auto: the model's)")
    _add(lora, "--fully-sharded-loras", action="store_true",
         help="also shard the slices every rank holds whole (refused: -tp N slices adapters without it)")


def parse_lora_module(text: str) -> LoRAModule:
    """`name=path` or a JSON object with name, path and optionally base_model_name."""
    text = text.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--lora-modules: invalid JSON {text!r}: {exc.msg}") from None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not isinstance(data.get("path"), str):
            raise ConfigError(f"--lora-modules: a JSON entry needs string fields name and path, got {text!r}")
        unknown = set(data) - {"name", "path", "base_model_name"}
        if unknown:
            raise ConfigError(f"--lora-modules: unknown field(s) {', '.join(sorted(unknown))} in {text!r}")
        return LoRAModule(data["name"], data["path"], data.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ConfigError(f"--lora-modules: expected name=path or a JSON object, got {text!r}")
    return LoRAModule(name, path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paphos", description="Paphos LLM server (Aphrodite-compatible).")
    parser.add_argument("--version", action="version", version=f"paphos {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{run,serve}")
    run = commands.add_parser(
        "run", aliases=["serve"], help="start the OpenAI-compatible server",
        formatter_class=_HelpFormatter,
        description="Start the OpenAI-compatible HTTP server. Every flag accepts - or _ (e.g. --max-model-len "
                    "or --max_model_len).",
    )
    _add_run_flags(run)
    return parser


def _flag_dests(parser: argparse.ArgumentParser) -> dict[str, str]:
    dests = {}
    for action in parser._actions:
        for option in action.option_strings:
            dests[option.lstrip("-").replace("-", "_")] = action.dest
    dests["model"] = "model"
    return dests


def _yaml_defaults(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--config: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {path} must hold a flat map of flags (`port: 2242`)")
    dests = _flag_dests(parser)
    defaults: dict[str, Any] = {}
    for key, value in data.items():
        dest = dests.get(str(key).replace("-", "_"))
        if dest is None or dest in ("config", "help"):
            raise ConfigError(f"--config: unknown flag {key!r} in {path}")
        if dest in _LIST_DESTS and isinstance(value, str):
            value = [value]
        elif dest.startswith("allowed_") and isinstance(value, str):
            value = parse_json_list(value)
        defaults[dest] = value
    return defaults


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        run_parser = parser._subparsers._group_actions[0].choices[args.command]  # type: ignore[union-attr]
        run_parser.set_defaults(**_yaml_defaults(args.config, run_parser))
        args = parser.parse_args(argv)  # again, so explicit flags win over the file
    return args


def _chat_template(value: str | None) -> str | None:
    """A file path or a literal template -> template text (a mistyped path is an error)."""
    if value is None:
        return None
    from paphos.tokenizer import resolve_chat_template

    try:
        return resolve_chat_template(value)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def build_configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """Namespace -> validated configs; raises ConfigError naming the flag."""
    model = args.model_positional or args.model
    served_names = tuple(args.served_model_name or ())
    if not model:
        from paphos.default_model import DEFAULT_SERVED_NAME, default_model_path

        model = str(default_model_path())
        # A cache path is a poor model id for clients; the bundled model gets a stable name.
        served_names = served_names or (DEFAULT_SERVED_NAME,)
    max_model_len = parse_max_model_len(args.max_model_len)
    batched = args.max_num_batched_tokens
    if batched is None and not args.enable_chunked_prefill:
        batched = max(max_model_len or 2048, 2048)
    model_config = ModelConfig(
        model=model, tokenizer=args.tokenizer, served_model_name=served_names,
        dtype=args.dtype, max_model_len=max_model_len, load_format=args.load_format, seed=args.seed,
        chat_template=_chat_template(args.chat_template), max_logprobs=args.max_logprobs, device=args.device,
        enforce_eager=args.enforce_eager, threads=args.threads, gguf_numerics=args.gguf_numerics,
        attention_backend=args.attention_backend, quantization=args.quantization,
        revision=args.revision, tokenizer_revision=args.tokenizer_revision, download_dir=args.download_dir,
    )
    cache = CacheConfig(
        block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_dtype=args.kv_cache_dtype,
        cpu_kv_cache_gb=args.cpu_kv_cache_gb, num_gpu_blocks_override=args.num_gpu_blocks_override,
    )
    scheduler = SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=batched,
        enable_chunked_prefill=args.enable_chunked_prefill, max_model_len=max_model_len or 2048,
        decode_lookahead=args.decode_lookahead,
    )
    api_keys = args.api_keys
    if api_keys is None:
        api_keys = [os.environ[API_KEY_ENV]] if os.environ.get(API_KEY_ENV) else []
    server = ServerConfig(
        host=args.host, port=args.port, uvicorn_log_level=args.uvicorn_log_level,
        disable_log_requests=args.disable_log_requests, return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        api_keys=tuple(api_keys), admin_key=args.admin_key or os.environ.get(ADMIN_KEY_ENV) or None,
        allowed_origins=tuple(args.allowed_origins), allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers), allow_credentials=args.allow_credentials,
        disable_log_stats=args.disable_log_stats, max_log_len=args.max_log_len,
        kobold_default_max_length=args.kobold_default_max_length, ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
        root_path=args.root_path, disable_fastapi_docs=args.disable_fastapi_docs,
        disable_web_ui=args.disable_web_ui,
        max_num_waiting=None if args.max_num_waiting == -1 else args.max_num_waiting,
        request_timeout_s=args.request_timeout, shutdown_timeout_s=args.shutdown_timeout,
    )
    lora_modules = tuple(parse_lora_module(m) for m in args.lora_modules or ())
    lora = LoRAConfig(
        enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras, lora_dtype=args.lora_dtype, fully_sharded_loras=args.fully_sharded_loras,
        lora_modules=lora_modules,
    )
    parallel = ParallelConfig(tensor_parallel_size=args.tensor_parallel_size)
    engine = EngineConfig(model=model_config, cache=cache, scheduler=scheduler, parallel=parallel, lora=lora)
    return engine, server


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


# After the engine core dies, /health answers 503 this long before the server exits, so health
# checks and clients see why instead of a refused connection.
ENGINE_DEATH_GRACE_S = 3.0


def _serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Serves until SIGINT / SIGTERM (exit 0), a model that fails to load or an engine core that
    dies (exit 1). uvicorn owns this process's main thread and signals; the engine core runs in a
    process of its own, which the app's shutdown stops."""
    import asyncio

    import uvicorn

    from paphos.engine.async_engine import AsyncEngine
    from paphos.server.app import build_app

    failures: list[str] = []
    server: uvicorn.Server | None = None

    def on_load_failure(exc: BaseException) -> None:
        failures.append(f"the model failed to load: {exc}")
        if server is not None:
            server.should_exit = True

    def on_dead(exc: BaseException) -> None:
        failures.append(f"the engine core died: {exc}")
        if server is not None:
            asyncio.get_running_loop().call_later(ENGINE_DEATH_GRACE_S, setattr, server, "should_exit", True)

    engine = AsyncEngine(
        engine_config, on_dead=on_dead, max_num_waiting=server_config.max_num_waiting,
        request_timeout_s=server_config.request_timeout_s,
    )
    app = build_app(engine, server_config, engine_config.model.served_names, on_engine_failure=on_load_failure)
    server = uvicorn.Server(uvicorn.Config(
        app, host=server_config.host, port=server_config.port, log_level=server_config.uvicorn_log_level,
        ssl_keyfile=server_config.ssl_keyfile, ssl_certfile=server_config.ssl_certfile,
        ssl_ca_certs=server_config.ssl_ca_certs, ssl_cert_reqs=server_config.ssl_cert_reqs,
        root_path=server_config.root_path,
        # Open SSE streams would otherwise hold Ctrl-C / SIGTERM until they finish.
        timeout_graceful_shutdown=server_config.shutdown_timeout_s,
    ))
    # uvicorn handles SIGINT / SIGTERM itself (graceful shutdown) and re-raises the signal once it
    # has stopped; the handlers in force then turn that into a clean exit.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if failures:
        print(f"paphos: error: {failures[0]}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    # Before the configs: building them may download a model (a repo id, the bundled default),
    # and those steps log what they fetch.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args = parse_args(argv)
        engine_config, server_config = build_configs(args)
    except ConfigError as exc:
        print(f"paphos: error: {exc}", file=sys.stderr)
        return 2
    return _serve(engine_config, server_config)


if __name__ == "__main__":
    sys.exit(main())
