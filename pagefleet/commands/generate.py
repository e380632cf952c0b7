"""`pagefleet generate "text"`: stream a completion to the terminal.

Offline (the default) it loads the model in this process and runs the paged
engine; with `--target HOST:PORT` it asks a running pagefleet server over gRPC.
`--chat` sends PROMPT as a user message through the model's chat template
(offline), so an instruct model answers it and stops at its end of turn.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from pagefleet.cli import CommandError
from pagefleet.commands import preflight
from pagefleet.commands.target import TARGET_HELP, describe_rpc_error, parse_target
from pagefleet.worker.config import DEFAULT_DTYPE, KV_CACHE_DTYPES
from pagefleet.worker.model_files import DEFAULT_MODEL


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `generate` subcommand."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "generate",
        help="generate text from a prompt (offline, or from a server with --target)",
        description="Generate a completion of PROMPT and stream it to stdout as it comes.",
    )
    parser.add_argument("prompt", help="the prompt text (with --chat: the user's message)")
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"offline: {DEFAULT_MODEL} (default), tiny (built-in, random), a .gguf file or "
        "an HF checkpoint directory",
    )
    parser.add_argument(
        "--chat", action="store_true", help="offline: PROMPT is a user message (chat template)"
    )
    parser.add_argument("--system", default=None, help="with --chat: a system message first")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens whose probability reaches P (1 = off)")
    parser.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    parser.add_argument("--seed", type=int, default=None, help="seed of this request's sampling")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    parser.add_argument("--dtype", default=DEFAULT_DTYPE, help="offline: model dtype")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="offline: what the KV cache stores (auto = the model dtype; float16 halves it)",
    )
    parser.add_argument("--device", default="cpu", help="offline: cpu or cuda[:N]")
    parser.add_argument(
        "--kv-memory",
        default=None,
        metavar="SIZE",
        help="offline: the KV pool's size, e.g. 512MiB, 8G, 2GB (default: the engine's, from "
        "the free memory)",
    )
    parser.add_argument("--target", default=None, metavar="HOST:PORT", help=TARGET_HELP)
    parser.add_argument("--pool", default="", help="with --target: the pool to use")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("PAGEFLEET_API_KEY"),
        help="with --target: the tenant's API key (default: $PAGEFLEET_API_KEY)",
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Generate and stream; exit code 0 on success."""
    from pagefleet.worker.sampling_params import SamplingParams
    from pagefleet.worker.sizes import parse_bytes

    try:
        args.kv_memory_bytes = None if args.kv_memory is None else parse_bytes(args.kv_memory)
    except ValueError as exc:
        raise CommandError(f"--kv-memory: {exc}") from exc
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
        )
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    if args.target:
        if args.chat:
            raise CommandError(
                "--chat runs offline; against a server use its OpenAI /v1/chat/completions"
            )
        return _run_remote(args, params)
    return _run_offline(args, params)


def _run_offline(args: argparse.Namespace, params: Any) -> int:
    from transformers.utils import logging as hf_logging

    from pagefleet.worker.chat import ChatTemplateError, chat_prompt
    from pagefleet.worker.config import EngineConfig
    from pagefleet.worker.engine import LLMEngine
    from pagefleet.worker.outputs import RequestError

    hf_logging.disable_progress_bar()  # stdout/stderr carry the completion only
    preflight.check_generate(args.model, args.device)
    try:
        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            device=args.device,
            kv_memory_bytes=args.kv_memory_bytes,
        )
        engine = LLMEngine(config)
        prompt: str | list[int] = args.prompt
        if args.chat:
            messages = [{"role": "user", "content": args.prompt}]
            if args.system is not None:
                messages.insert(0, {"role": "system", "content": args.system})
            try:
                prompt = chat_prompt(messages, engine.tokenizer)
            except ChatTemplateError as exc:
                raise RequestError(str(exc)) from exc
        engine.add_request("cli", prompt, params)
    except (ValueError, FileNotFoundError) as exc:  # RequestError is a ValueError
        kind = "request" if isinstance(exc, RequestError) else "model"
        raise CommandError(f"bad {kind}: {exc}") from exc
    while engine.has_unfinished_requests():
        for out in engine.step():
            _write(out.new_text)
    _write("\n")
    return 0


def _run_remote(args: argparse.Namespace, params: Any) -> int:
    try:
        from pagefleet.cluster.client import stream_generate
    except ImportError as exc:
        raise CommandError(f"--target needs the cluster client, which is unavailable: {exc}") from exc
    import grpc

    try:
        target = parse_target(args.target)
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    try:
        for response in stream_generate(
            target, args.prompt, params, pool=args.pool, api_key=args.api_key
        ):
            _write(response.text)
    except grpc.RpcError as exc:
        raise CommandError(describe_rpc_error(target, exc)) from exc
    _write("\n")
    return 0


def _write(text: str) -> None:
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()
