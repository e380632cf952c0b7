"""`pagefleet plan`: how many KV tokens and concurrent sequences a memory budget holds."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pagefleet.worker.config import DEFAULT_DTYPE, KV_CACHE_DTYPES


def register(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "plan",
        help="KV cache capacity of a memory budget for a model",
        description="Print KV bytes per token and per block, the blocks and tokens a budget "
        "holds, and how many concurrent sequences fit paged versus reserving max_model_len "
        "each. KV costs tokens x layers x kv_heads x head_dim x 2 x dtype bytes.",
    )
    parser.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (the built-in model), smollm2-135m-instruct, a .gguf file, an HF "
        "checkpoint directory, or a config.json",
    )
    parser.add_argument(
        "--budget", default="4GiB", help="KV memory budget, e.g. 4GiB, 8G (binary), 80GB (decimal), 1000000"
    )
    parser.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV block (power of two)"
    )
    parser.add_argument(
        "--dtype",
        default=DEFAULT_DTYPE,
        help=f"model dtype, which the KV cache stores unless --kv-cache-dtype says otherwise "
        f"(float16, bfloat16, float32, fp8 for planning only); default {DEFAULT_DTYPE}, the "
        "engine's own default",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="what the KV cache stores, as the engine option: auto = --dtype; float16 "
        "holds twice the tokens of a float32 model in the same budget",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest sequence (default: the config's max_position_embeddings)",
    )
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per sequence")
    parser.add_argument("--output-len", type=int, default=None, help="output tokens per sequence")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=run)
    return parser


def load_model_config(model: str) -> tuple[str, Any]:
    """`(display name, config)` for 'tiny', a checkpoint directory or a config.json file."""
    from pagefleet.cli import CommandError

    if model == "tiny":
        from pagefleet.worker.tiny_model import tiny_model_config

        return "the built-in tiny model", tiny_model_config()
    from pagefleet.worker.model_files import PACKAGED_MODELS, ModelFileError, resolve_model_path

    path = Path(model)
    if model in PACKAGED_MODELS or path.suffix == ".gguf":
        try:  # a GGUF's shape is in its converted config.json
            path = resolve_model_path(model)
        except ModelFileError as exc:
            raise CommandError(str(exc)) from exc
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise CommandError(
            f"model {model!r} not found: expected 'tiny', a checkpoint directory with a "
            "config.json, or a config.json file"
        )
    try:
        config = json.loads(path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CommandError(f"cannot read {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise CommandError(f"{path} does not hold a JSON object")
    return model, config


def _config_value(config: Any, name: str) -> Any:
    if isinstance(config, dict):
        return config.get(name, (config.get("text_config") or {}).get(name))
    return getattr(config, name, None)


def run(args: argparse.Namespace) -> int:
    from pagefleet.cli import CommandError
    from pagefleet.worker.capacity import CapacityPlan
    from pagefleet.worker.kv_cache import ModelShape, parse_dtype
    from pagefleet.worker.sizes import parse_bytes

    try:
        budget = parse_bytes(args.budget)
        dtype = parse_dtype(args.dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype)
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    name, config = load_model_config(args.model)
    try:
        shape = ModelShape.from_hf_config(config, dtype)
    except (ValueError, TypeError) as exc:
        raise CommandError(f"{name}: {exc}") from exc

    limit = _config_value(config, "max_position_embeddings")
    if args.max_model_len and limit and args.max_model_len > int(limit):
        raise CommandError(
            f"--max-model-len {args.max_model_len} exceeds {name}'s limit of {int(limit)} "
            "tokens (max_position_embeddings)"
        )
    max_model_len = args.max_model_len or limit
    if not max_model_len:
        raise CommandError(f"{name} has no max_position_embeddings; pass --max-model-len")
    max_model_len = int(max_model_len)
    # Defaults: a typical chat mix that fits any max_model_len.
    prompt_len = (
        args.prompt_len if args.prompt_len is not None else min(512, max(1, max_model_len // 2))
    )
    output_len = args.output_len if args.output_len is not None else min(128, max_model_len // 4)
    try:
        plan = CapacityPlan(
            shape,
            budget,
            block_size=args.block_size,
            max_model_len=max_model_len,
            prompt_len=prompt_len,
            output_len=output_len,
        )
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    print(json.dumps(plan.as_dict(), indent=2) if args.json else plan.report(name))
    return 0
