"""``python -m dynarl.testing.fake_sglang``: a fake SGLang server in the foreground,
started the way dynarl's launcher starts ``python -m sglang.launch_server`` (set
``rollout.sglang.launch_command`` to this module's command line)."""

import argparse
import os

import msgspec
import torch

from dynarl.testing.fake_sglang.server import DEFAULT_VERSION, FakeSGLang
from dynarl.workers.config import ModelConfig


def main(argv: list[str] | None = None) -> None:
    """Serve until signalled, taking the flags of ``sglang.launch_server`` that
    dynarl's launcher passes (others are ignored): ``--model-path`` (a checkpoint
    directory), ``--context-length``, ``--dtype``, ``--random-seed``,
    ``--max-running-requests`` (unset: it runs 16 at once), ``--max-total-tokens``,
    ``--tp-size``, the memory-saver, priority-scheduling and metrics flags (with
    ``SGLANG_ENABLE_METRICS_DEVICE_TIMER=1`` in the environment, forward passes are
    timed, as SGLang reads it); and ``--dynarl-version``, the SGLang version it
    reports."""
    parser = argparse.ArgumentParser(prog="python -m dynarl.testing.fake_sglang")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--max-running-requests", type=int, default=None)
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--tp", "--tp-size", type=int, default=1)
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true")
    parser.add_argument("--enable-priority-scheduling", action="store_true")
    parser.add_argument("--incremental-streaming-output", action="store_true")
    parser.add_argument("--enable-metrics", action="store_true")
    parser.add_argument("--dynarl-version", default=DEFAULT_VERSION)
    args, _ = parser.parse_known_args(argv)
    model = ModelConfig(path=args.model_path)
    if args.context_length is not None:
        model = msgspec.structs.replace(model, max_seq_len=args.context_length)
    if args.dtype in ("float32", "bfloat16"):
        model = msgspec.structs.replace(model, dtype=args.dtype)
    torch.set_num_threads(1)
    FakeSGLang(
        model,
        seed=args.random_seed,
        max_running_requests=args.max_running_requests or 16,
        requested_max_running_requests=args.max_running_requests,
        kv_capacity_tokens=args.max_total_tokens,
        version=args.dynarl_version,
        enable_memory_saver=args.enable_memory_saver,
        enable_weights_cpu_backup=args.enable_weights_cpu_backup,
        enable_priority_scheduling=args.enable_priority_scheduling,
        incremental_streaming_output=args.incremental_streaming_output,
        enable_metrics=args.enable_metrics,
        metrics_device_timer=os.environ.get("SGLANG_ENABLE_METRICS_DEVICE_TIMER", "")
        .strip()
        .lower()
        in ("1", "true", "yes", "y"),
        tp=args.tp,
        host=args.host,
        port=args.port,
    ).serve_forever()


if __name__ == "__main__":
    main()
