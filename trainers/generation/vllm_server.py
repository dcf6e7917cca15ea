"""``trainers vllm-serve``: a vLLM server that GRPO's ``vllm_mode="server"`` generates with and pushes weights into.

    trainers vllm-serve --model Qwen/Qwen2.5-0.5B-Instruct --port 8000             # vLLM in the trainer's environment
    trainers vllm-serve --model M --python vllm-env/bin/python                     # vLLM in an environment of its own
    vllm-env/bin/python path/to/trainers/generation/vllm_server.py --model M             # no trainer environment at all

TRL's ``trl vllm-serve`` options (underscores or dashes); any other flag goes to vLLM as is. It runs
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm serve`` console script fails with the CPU wheel) with
``VLLM_SERVER_DEV_MODE=1`` (the weight-update endpoints), TRL's logprob settings, and our weight-transfer engine
(trainers/generation/vllm_worker/trainers_vllm_worker.py: gloo over TCP, so it works on CPU as on GPU), which vLLM's worker
imports through ``--worker-extension-cls`` (on a GPU, vLLM's own NCCL engine instead: ``--weight_transfer``), and ``--enable-scale-out`` (vLLM's token route,
``/inference/v1/generate``, whose answers tag each token with the weight version that sampled it: asynchronous
GRPO samples through it, pushing weights while requests are in flight). The trainer connects with ``VLLMClient`` (trainers/generation/vllm_client.py).
With vLLM's ``--enable-lora --max-lora-rank R`` (passed through) it also sets VLLM_ALLOW_RUNTIME_LORA_UPDATING=1:
a LoRA policy's trainer then sends its adapter alone at each sync (vllm_lora_sync; generation/vllm_lora.py).

It listens on 127.0.0.1 unless ``--host`` says otherwise. With a key (``--api-key``, or TRAINERS_VLLM_API_KEY; one
is generated and printed when the host is not a loopback address and none is given), every route answers 401
without it: generation, the weight transfer and vLLM's development routes alike
(trainers/generation/vllm_worker/trainers_vllm_auth.py, loaded with ``--middleware``). The key reaches the server
in its environment, not on its command line. The trainer sends it (vllm_server_api_key, or the same variable).

This file imports only the standard library: it runs as a script in a vLLM-only environment, and the server it
starts needs only vLLM plus the worker module's folder on PYTHONPATH, never the ``trainers`` package.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import secrets
import shlex
import subprocess
import sys

WORKER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_worker")  # holds only the worker module
WORKER_EXTENSION = "trainers_vllm_worker.TrainersWorkerExtension"
ENGINE_NAME = "trainers_gloo"  # the worker module's ENGINE_NAME
KEY_VARIABLE = "TRAINERS_VLLM_API_KEY"  # the key, for the server (and the trainer) when --api-key is not given
KEY_MIDDLEWARE = "trainers_vllm_auth.RequireKey"  # in WORKER_DIR: every route behind the key
ROUTES_MIDDLEWARE = "trainers_vllm_routes.WeightRoutes"  # in WORKER_DIR: a weight update opened and closed in one call


def build_parser(prog: str = "trainers vllm-serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)

    def add(name: str, **kwargs) -> None:  # TRL's parser takes --tensor_parallel_size and --tensor-parallel-size
        flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        parser.add_argument(*flags, dest=name, **kwargs)

    add("model", required=True, help="Model folder or Hub id to serve: the one the trainer trains.")
    add("revision", default=None, help="Model revision (branch, tag or commit).")
    add("tensor_parallel_size", type=int, default=1, help="Tensor-parallel workers.")
    add("data_parallel_size", type=int, default=1, help="Data-parallel replicas (keep 1 for dense models).")
    add("host", default="127.0.0.1",
        help="Address the server listens on: this machine only by default; 0.0.0.0 (or an interface's address) "
             "for trainers on other machines, which needs a key (--api-key).")
    add("api_key", default=None,
        help=f"The key every request must carry (Authorization: Bearer KEY), on every route. Default: "
             f"{KEY_VARIABLE}; with neither, none on a loopback host, and one generated and printed otherwise. "
             f"The trainer sends it from vllm_server_api_key or {KEY_VARIABLE}.")
    add("port", type=int, default=8000, help="Port the server listens on.")
    add("gpu_memory_utilization", type=float, default=0.9,
        help="GPU: fraction of its memory for weights, activations and KV cache. On CPU see --cpu_kvcache_space.")
    add("cpu_kvcache_space", type=int, default=1,
        help="CPU only: GiB of host memory for the KV cache (VLLM_CPU_KVCACHE_SPACE, which wins when set). vLLM "
             "would otherwise read --gpu_memory_utilization as a fraction of host RAM.")
    add("dtype", default="auto", help="Weights' dtype in the engine (auto: the model's).")
    add("max_model_len", type=int, default=None, help="Longest prompt + completion (default: the model's context).")
    add("enable_prefix_caching", type=_bool, default=None, help="true/false (default: vLLM's).")
    add("enforce_eager", type=_bool, nargs="?", const=True, default=False,
        help="No CUDA graphs / compilation: faster start-up, slower decoding.")
    add("kv_cache_dtype", default="auto", help="KV cache dtype (auto: the model's).")
    add("trust_remote_code", type=_bool, nargs="?", const=True, default=False, help="Run the model repo's code.")
    add("log_level", default="info", help="uvicorn's log level.")
    add("vllm_model_impl", default="vllm", choices=["vllm", "transformers", "auto"], help="Model implementation.")
    add("distributed_executor_backend", default=None, help="ray for multi-node tensor parallelism.")
    add("speculative_config", default=None, help="JSON for vLLM's --speculative-config.")
    add("weight_transfer", default="auto", choices=["auto", "gloo", "nccl"],
        help="How the trainer's weights reach the server: nccl (vLLM's own engine, GPU to GPU: the trainer needs a GPU "
             "of its own and vLLM), gloo (ours, through host memory: CPU, or a trainer without vLLM). auto: nccl when "
             "the server's Python sees a CUDA device, else gloo.")
    add("python", default=sys.executable,
        help="The Python that runs the server: one whose environment has vLLM (default: this one).")
    return parser


def _bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def resolve_model(model: str) -> str:
    """A local folder as an absolute path (it is the name /v1/models reports, which VLLMClient.check_server
    compares with the trainer's model); a missing local path is an error naming it."""
    if os.path.isdir(model):
        return os.path.abspath(model)
    if model.startswith(("/", "./", "../", "~")) or model.count("/") > 1:
        raise SystemExit(f"trainers vllm-serve: error: --model {model!r}: no such folder (and not a Hub id).")
    return model  # a Hub id


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine alone."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: assume it is reachable from elsewhere
        return False


def resolve_key(args: argparse.Namespace, environ: dict[str, str] | None = None) -> tuple[str | None, bool]:
    """(the server's key, whether it was generated): --api-key, else the environment's, else on a host that is
    not a loopback address a new one (none on a loopback host: only this machine can reach it)."""
    environ = os.environ if environ is None else environ
    key = args.api_key or environ.get(KEY_VARIABLE) or None
    if key is None and not is_loopback(args.host):
        return secrets.token_urlsafe(24), True
    return key, False


def resolve_transfer(args: argparse.Namespace, has_cuda=None) -> str:
    """--weight_transfer, with auto resolved: nccl when the server's Python sees a CUDA device (``has_cuda()``,
    default: asked of that Python), else gloo."""
    if args.weight_transfer != "auto":
        return args.weight_transfer
    if has_cuda is None:
        def has_cuda() -> bool:
            probe = subprocess.run([args.python, "-c", "import torch; print(torch.cuda.is_available())"],
                                   capture_output=True, text=True)
            return probe.stdout.strip() == "True"
    return "nccl" if has_cuda() else "gloo"


def build_command(args: argparse.Namespace, extra_args: list[str], key: str | None = None) -> list[str]:
    """The server's command line, starting with the Python that runs it (--weight_transfer resolved: auto is gloo
    here)."""
    command = [
        args.python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", resolve_model(args.model),
        "--host", args.host,
        "--port", str(args.port),
        "--tensor-parallel-size", str(args.tensor_parallel_size),
        "--data-parallel-size", str(args.data_parallel_size),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--dtype", args.dtype,
        "--kv-cache-dtype", args.kv_cache_dtype,
        "--model-impl", args.vllm_model_impl,
        "--uvicorn-log-level", args.log_level,
    ]
    if args.revision is not None:
        command += ["--revision", args.revision]
    if args.max_model_len is not None:
        command += ["--max-model-len", str(args.max_model_len)]
    if args.enable_prefix_caching is not None:
        command += ["--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching"]
    if args.enforce_eager:
        command += ["--enforce-eager"]
    if args.trust_remote_code:
        command += ["--trust-remote-code"]
    if args.distributed_executor_backend is not None:
        command += ["--distributed-executor-backend", args.distributed_executor_backend]
    if args.speculative_config is not None:
        command += ["--speculative-config", args.speculative_config]
    # the weight route, /trainers/weight_update (trainers_vllm_routes.py); added first, so the key's middleware wraps it
    command += ["--middleware", ROUTES_MIDDLEWARE]
    if key is not None:  # every route behind the key (the key itself travels in the environment: build_env)
        command += ["--middleware", KEY_MIDDLEWARE]
    command += [
        # our transfer engine, registered by the worker module that vLLM's worker imports
        "--worker-extension-cls", WORKER_EXTENSION,
        "--weight-transfer-config", json.dumps({"backend": "nccl" if args.weight_transfer == "nccl" else ENGINE_NAME}),
        # as TRL: log-probs after temperature/top-k processing (the importance-sampling correction compares
        # them with the trainer's), and no cap on how many per token
        "--logprobs-mode", "processed_logprobs",
        "--max-logprobs", "-1",
        # the token route (/inference/v1/generate): each token's weight version, for in-flight weight updates
        "--enable-scale-out",
    ]
    return command + list(extra_args)


def build_env(args: argparse.Namespace, base: dict[str, str] | None = None, key: str | None = None,
              extra_args: list[str] = ()) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    if "--enable-lora" in extra_args or "--enable_lora" in extra_args:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # /v1/load_lora_adapter: the trainer's adapter at each sync
    env.pop(KEY_VARIABLE, None)
    if key is not None:
        env[KEY_VARIABLE] = key  # read by the middleware (KEY_MIDDLEWARE)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /init_weight_transfer_engine, /update_weights, /reset_prefix_cache, ...
    env["PYTHONPATH"] = os.pathsep.join([WORKER_DIR] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.cpu_kvcache_space))  # read by vLLM's CPU platform only
    return env


def main(argv: list[str] | None = None) -> int:
    args, extra_args = build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    if not os.path.isfile(args.python):
        raise SystemExit(f"trainers vllm-serve: error: --python {args.python!r}: no such file.")
    args.weight_transfer = resolve_transfer(args)
    key, generated = resolve_key(args)
    command = build_command(args, extra_args, key)
    env = build_env(args, key=key, extra_args=extra_args)
    if generated:
        print(f"[trainers vllm-serve] {args.host} is reachable from other machines and no key was given: every "
              f"request must carry this one. Give it to the trainer as vllm_server_api_key or {KEY_VARIABLE}:\n"
              f"{KEY_VARIABLE}={key}", flush=True)
    elif key is None:
        print(f"[trainers vllm-serve] no key: only this machine can reach {args.host}.", flush=True)
    lora = " VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" if "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in env else ""
    print(f"[trainers vllm-serve] VLLM_SERVER_DEV_MODE=1{lora} VLLM_CPU_KVCACHE_SPACE="
          f"{env['VLLM_CPU_KVCACHE_SPACE']} PYTHONPATH={shlex.quote(env['PYTHONPATH'])} {shlex.join(command)}",
          flush=True)
    # the server replaces this process: signals reach it directly and nothing is left behind when it exits
    os.execve(command[0], command, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
