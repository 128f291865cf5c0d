"""The SGLang backend (adapter + launched fake servers) against the torch backend on
the default job, in every scheduling mode, same seeds: does a run with
``rollout.backend=sglang`` learn as the torch one does?

Each (mode, backend) pair is one ``dynarl run`` of the default job for
``--iterations`` iterations; the SGLang runs launch ``dynarl.testing.fake_sglang``
servers in place of ``sglang.launch_server`` (``rollout.sglang.launch_command``).
Prints a table of mean rewards per iteration and one JSON line::

    python bench/sglang_fake_e2e.py [--iterations 3] [--modes dynamic ...]

The fake server runs the torch reference engine, so this measures the adapter's and
the launcher's effect on a run, not SGLang's speed.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("dynamic", "static-colocated", "static-disaggregated")
FAKE = "rollout.sglang.launch_command=[python, -m, dynarl.testing.fake_sglang]"


def run(mode: str, backend: str, iterations: int, out: Path) -> dict[str, object]:
    run_dir = out / f"{mode}-{backend}"
    command = [
        sys.executable, "-c", "from dynarl.cli import main; main()", "run",
        "--set", f"scheduler.mode={mode}",
        "--set", f"rollout.backend={backend}",
        "--set", f"run.num_iterations={iterations}",
        "--set", f"run.run_dir={run_dir}",
        "--set", "run.checkpoint_every=0",
    ]  # fmt: skip
    if backend == "sglang":
        command += ["--set", FAKE]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    elapsed_s = time.perf_counter() - started
    if done.returncode != 0:
        return {"ok": False, "elapsed_s": elapsed_s, "error": done.stderr[-2000:]}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "ok": True,
        "elapsed_s": round(elapsed_s, 1),
        "rewards": [round(r["mean_reward"], 4) for r in rows],
        "weight_versions": [r["weight_version"] for r in rows],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--modes", nargs="*", default=list(MODES))
    args = parser.parse_args()
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="dynarl-sglang-e2e-") as tmp:
        for mode in args.modes:
            for backend in ("torch", "sglang"):
                results[f"{mode}/{backend}"] = result = run(
                    mode, backend, args.iterations, Path(tmp)
                )
                print(f"{mode:22s} {backend:7s} {result}", flush=True)
    print()
    print(f"{'mode':22s} {'backend':7s} rewards by iteration")
    for key, result in results.items():
        mode, backend = key.split("/")
        print(f"{mode:22s} {backend:7s} {result.get('rewards', 'FAILED')}")
    print(json.dumps({"bench": "sglang_fake_e2e", "results": results}))


if __name__ == "__main__":
    main()
