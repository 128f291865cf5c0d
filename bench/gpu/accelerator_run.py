"""Check ``cluster.accelerator=cuda`` end to end on a GPU machine: two-iteration
``dynarl run``s whose trainer, torch engines and Megatron inference worker run on the
GPUs (one GPU is enough: the devices share it, device ``d`` on GPU ``d % N``).

    python bench/gpu/accelerator_run.py [--accelerator cuda] [--only torch|megatron]

Runs, one line each, then a JSON summary (exit code 1 if any failed):

1. ``torch``: the default job (torch rollout, inference and trainer).
2. ``megatron``: ``actor.backend=megatron`` and ``inference.backend=megatron``.

Each must finish its two iterations (``metrics.jsonl``) with finite losses and, on
``cuda``, its worker processes must show up on the GPU (``nvidia-smi``'s compute apps,
polled while the run runs): a run that silently trained on the CPU fails.

Needs a CUDA torch and transformers, and megatron-core 0.16 for the second run (carry
its wheel, with pyzmq and msgspec, to a machine without them). ``--accelerator cpu`` is
a dry run of the script on the CPU (nothing is looked for on a GPU).
"""

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

RUNS: dict[str, list[str]] = {
    "torch": [],
    "megatron": ["actor.backend=megatron", "inference.backend=megatron"],
}

COMMON = ["run.num_iterations=2", "run.checkpoint_every=0"]


def gpu_pids() -> set[int]:
    """Process ids of the compute apps on this machine's GPUs now."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    )
    return {int(line) for line in out.stdout.split() if line.strip().isdigit()}


def run(name: str, accelerator: str, out_dir: Path, timeout_s: float) -> dict[str, Any]:
    """One two-iteration run; what it did."""
    overrides = [*COMMON, f"cluster.accelerator={accelerator}", *RUNS[name]]
    command = [sys.executable, "-m", "dynarl.cli", "run", "--out", str(out_dir)]
    for override in overrides:
        command += ["--set", override]
    seen: set[int] = set()
    done = threading.Event()
    watch = accelerator == "cuda" and shutil.which("nvidia-smi") is not None

    def poll() -> None:
        while not done.wait(0.5):
            seen.update(gpu_pids())

    watcher = threading.Thread(target=poll, daemon=True)
    if watch:
        watcher.start()
    started = time.perf_counter()
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, check=False, timeout=timeout_s
        )
    finally:
        done.set()
        if watch:
            watcher.join()
    elapsed = time.perf_counter() - started
    lines = (out_dir / "metrics.jsonl").read_text().splitlines() if result.returncode == 0 else []
    metrics = [json.loads(line) for line in lines if line.strip()]
    losses = [m.get("loss") for m in metrics]
    report: dict[str, Any] = {
        "returncode": result.returncode,
        "iterations": len(metrics),
        "losses": losses,
        "rewards": [m.get("mean_reward") for m in metrics],
        "wall_s": round(elapsed, 1),
        "gpu_processes_seen": len(seen) if watch else None,
    }
    ok = (
        result.returncode == 0
        and len(metrics) == 2
        and all(isinstance(x, float) and math.isfinite(x) for x in losses)
    )
    if accelerator == "cuda":
        # The trainer workers and the slots: at least the trainer's and one engine's.
        ok = ok and watch and len(seen) >= 2
    report["ok"] = ok
    if not ok:
        report["stderr_tail"] = result.stderr[-3000:]
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accelerator", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--only", choices=sorted(RUNS), action="append")
    parser.add_argument("--timeout-s", type=float, default=280.0)
    args = parser.parse_args()
    if args.accelerator == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device here; run with --accelerator cpu for a dry run")
            return 1
    results: dict[str, Any] = {}
    for name in args.only or list(RUNS):
        with tempfile.TemporaryDirectory(prefix=f"dynarl-{name}-") as tmp:
            try:
                results[name] = run(name, args.accelerator, Path(tmp) / "run", args.timeout_s)
            except Exception as e:  # a timeout, a missing file: the check failed
                results[name] = {"ok": False, "error": repr(e)}
        print(f"{name}: {'ok' if results[name]['ok'] else 'FAILED'} {results[name]}", flush=True)
    print(json.dumps({"accelerator": args.accelerator, "runs": results}, indent=1))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
