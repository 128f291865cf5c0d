"""Check the SGLang adapter against a real SGLang server on a GPU machine: launch it,
generate, abort and resume, read its step counters (``/metrics``), and sync weights
from a trainer-side copy of the model.

    python bench/gpu/sglang_check.py --model-path /path/to/Qwen2.5-0.5B-Instruct

Prints one line per check and a JSON summary; exits non-zero on a failed check.
Needs sglang 0.5.x and a CUDA torch on this machine (never on the CPU machines).
"""

import argparse
import json
import socket

import anyio
from transformers import AutoModelForCausalLM

from dynarl.workers.config import ModelConfig, RolloutConfig
from dynarl.workers.protocol import RolloutRole
from dynarl.workers.rollout import GenerateRequest, SamplingParams
from dynarl.workers.sglang.backend import BACKEND
from dynarl.workers.sglang.config import SGLangConfig
from dynarl.workers.torch import weight_sync
from dynarl.workers.weights import WeightSyncGroup


async def main(model_path: str) -> dict[str, object]:
    results: dict[str, object] = {}
    role = RolloutRole(
        model=ModelConfig(path=model_path, max_seq_len=4096),
        rollout=RolloutConfig(backend="sglang", sglang=SGLangConfig(weight_sync_backend="nccl")),
    )
    engine = await anyio.to_thread.run_sync(
        lambda: BACKEND.build_rollout(role, name="slot-0", num_threads=1)
    )
    completions: dict[str, object] = {}
    taken: dict[str, GenerateRequest] = {}

    class _Sink:
        def done(self, c: object) -> None:
            completions[c.request_id] = c  # type: ignore[attr-defined]

        def aborted(self, r: GenerateRequest) -> None:
            taken[r.request_id] = r

        async def flush(self) -> None: ...

        async def fail(self, error: Exception) -> None:
            raise error

    sampling = SamplingParams(temperature=1.0, max_new_tokens=256, ignore_eos=True, seed=7)
    requests = [
        GenerateRequest(request_id=f"r{i}", prompt_ids=(151644, 872, 198 + i), sampling=sampling)
        for i in range(8)
    ]
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            await engine.submit(requests, _Sink())
            await anyio.sleep(1.0)
            aborted = await engine.abort(None)
            results["abort_partial_tokens"] = [len(r.output_ids) for r in aborted]
            await engine.submit(aborted, _Sink())
            for _ in range(3000):  # up to 300 s
                if len(completions) == 8:
                    break
                await anyio.sleep(0.1)
            results["resumed_lengths"] = sorted(len(c.output_ids) for c in completions.values())  # type: ignore[attr-defined]
            results["resume_ok"] = all(n == 256 for n in results["resumed_lengths"])  # type: ignore[union-attr]
            # The server's step counters (/metrics, read every stats_interval_s): decode
            # steps, their device seconds, and the tokens they made.
            await anyio.sleep(2.5 * role.rollout.sglang.stats_interval_s)
            load = engine.load()
            results["step_counts"] = {
                "decode_steps": load.decode_steps,
                "decode_s": load.decode_s,
                "prefill_s": load.prefill_s,
                "resume_prefill_s": load.resume_prefill_s,
                "decode_tokens": load.decode_tokens,
                "tokens_per_step": load.decode_tokens / max(1, load.decode_steps),
            }
            results["steps_ok"] = load.decode_steps > 0 and load.decode_s > 0
            model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype="auto").cuda()
            manifest = weight_sync.manifest_of(model, version=1, bucket_bytes=256 << 20)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            group = WeightSyncGroup(host="127.0.0.1", port=port, rank=1, world_size=2)
            sender: list[object] = []
            async with anyio.create_task_group() as join:
                join.start_soon(
                    anyio.to_thread.run_sync,
                    lambda: sender.append(
                        weight_sync.join_weight_sync_group(
                            host="127.0.0.1",
                            port=port,
                            rank=0,
                            world_size=2,
                            device=model.device,
                            timeout_s=120.0,
                        )
                    ),
                )
                await engine.join_weight_sync(group)
            async with anyio.create_task_group() as sync:
                sync.start_soon(
                    anyio.to_thread.run_sync,
                    lambda: weight_sync.send_by_manifest(model, manifest, group=sender[0]),
                )
                results["weight_version"] = await engine.receive_weights(manifest)
            tg.cancel_scope.cancel()
    finally:
        engine.close()
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    out = anyio.run(main, parser.parse_args().model_path)
    print(json.dumps(out, indent=2))
    ok = out.get("resume_ok") and out.get("steps_ok") and out.get("weight_version") == 1
    raise SystemExit(0 if ok else 1)
