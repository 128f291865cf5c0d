"""Measure the reference CPU workers, for the simulator's CPU profile.

One process, one torch thread (a device slot's size by default), the embedded model
shape unless ``--set model.*=...`` says otherwise:

- rollout decode step time against batch and held context (``RolloutEngine``);
- prefill time against prompt tokens;
- log-prob inference time against micro-batch tokens (``InferenceWorker``);
- one optimizer step against minibatch rows and width (``ElasticTrainer``, one rank).

Each is fitted by least squares (:mod:`dynarl.workers.torch.profiling`, which
``dynarl profile`` runs to write a profile file) and printed as a table and one JSON
line whose numbers are what :data:`dynarl.sim.cpu_profile.CPU_1T` holds
(``bench/e2e_cpu.py --sim`` and ``bench/sim_fidelity.py`` measure them again around
their own runs). On a shared machine the figures drift with the other tenants' load,
so every coefficient is the median of ``--repeat`` rounds.

``--host-scaling N`` measures only how 1..N slots decoding at once slow each other down
(:mod:`dynarl.workers.torch.host_scaling`): the profile's ``host_slowdown`` curve::

    python bench/profile_cpu.py [--repeat 3] [--threads 1] [--set model.hidden_size=128]
    python bench/profile_cpu.py --host-scaling 4 [--repeat 1]
"""

import argparse
import json
import time

from dynarl.api.config import DynaRLConfig
from dynarl.api.config_io import apply_overrides
from dynarl.sim.profile_file import profile_from
from dynarl.workers.torch.host_scaling import host_slowdown
from dynarl.workers.torch.profiling import measure

__all__ = ["host_slowdown", "measure", "profile_from"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--host-scaling",
        type=int,
        metavar="N",
        help="only measure how 1..N slots decoding at once slow each other down (the "
        "profile's host_slowdown curve)",
    )
    args = parser.parse_args()
    cfg = apply_overrides(DynaRLConfig(), args.set)
    if args.host_scaling:
        t0 = time.perf_counter()
        curve = host_slowdown(
            cfg.model, cfg.rollout, args.host_scaling, threads=args.threads, repeat=args.repeat
        )
        for n, factor in enumerate(curve, start=1):
            print(f"{n} slot(s) decoding at once: each step x{factor:.2f}")
        print(f"({time.perf_counter() - t0:.1f} s)")
        print(json.dumps({"bench": "host_scaling", "threads": args.threads, "slowdown": curve}))
        return
    t0 = time.perf_counter()
    out = measure(cfg, repeat=args.repeat, threads=args.threads)
    for key, value in out.items():
        print(f"{key:28s} {value * 1e3:9.4f} ms")
    print(f"({time.perf_counter() - t0:.1f} s)")
    print(json.dumps({"bench": "profile_cpu", "threads": args.threads, **out}))


if __name__ == "__main__":
    main()
