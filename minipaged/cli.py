"""The ``minipaged`` command: exercises, grading and the demo."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# EngineConfig's logprobs modes (vLLM V1's), named here so that the command line starts without torch
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


def _exercise(args: argparse.Namespace) -> int:
    from minipaged.learn.exercise import files_to_write, make_workspace

    out = Path(args.out or f"minipaged-exercise-{args.stage}")
    workspace = make_workspace(args.stage, out, force=args.force)
    files = " and ".join(f"minipaged/{path.name}" for path in files_to_write(args.stage, workspace / "minipaged"))
    print(f"Exercise {args.stage} written to {workspace}: the stubs are in {files}.")
    print(f"Fill in the stubs, then run: cd {workspace} && {sys.executable} -m pytest -k stage{args.stage}")
    print(f"Grade every stage: {sys.executable} -m minipaged.cli grade {workspace}  (one stage: --stage {args.stage})")
    return 0


def _mutants(args: argparse.Namespace) -> int:
    from minipaged.learn.exercise import PACKAGE_DIR, find_workspace

    workspace = find_workspace(Path.cwd()) or find_workspace(PACKAGE_DIR.parent)
    if workspace is not None or not (PACKAGE_DIR / "learn" / "mutants.py").is_file():
        print(f"minipaged mutants: not available in an exercise workspace ({workspace or PACKAGE_DIR.parent}): "
              "its catalogue quotes the solutions, so workspaces leave it out; run it in a clone of "
              "the minipaged repository", file=sys.stderr)
        return 2
    from minipaged.learn.mutants import KILLED_BY_FILE, format_mutants, record_killers, run_mutants

    results = run_mutants(args.stage, progress=lambda r: print(
        f"  stage {r.mutant.stage}: {r.mutant.name}: {r.killed_by or 'SURVIVED'}", file=sys.stderr, flush=True))
    print(format_mutants(results))
    if args.record:
        record_killers(results)
        print(f"the killing tests recorded in {KILLED_BY_FILE}")
    return 0 if all(r.killed for r in results) else 1


def _set_threads(args: argparse.Namespace, quiet: bool = False) -> None:
    from minipaged.common.threads import apply_threads

    n = apply_threads(args.threads)
    if not quiet:  # serve says it in its one startup line
        print(f"torch threads: {n} ({'--threads' if args.threads else 'free cores'})", file=sys.stderr)


def _given(args: argparse.Namespace, *names: str) -> dict:
    """The options among ``names`` given on the command line: the others keep the engine's defaults."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _serve(args: argparse.Namespace) -> int:
    from minipaged.serving import serve

    _set_threads(args, quiet=True)

    serve(args.model, args.host, args.port, args.max_waiting, api_key=args.api_key or os.environ.get("VLLM_API_KEY"),
          shutdown_timeout=args.shutdown_timeout, max_logprobs=args.max_logprobs,
          max_body_bytes=args.max_request_body_bytes, read_timeout=args.request_read_timeout,
          served_model_name=args.served_model_name, block_size=args.block_size,
          num_gpu_blocks=args.num_gpu_blocks, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
          preemption_mode=args.preemption_mode, attention_backend=args.backend, dtype=args.dtype,
          device=args.device, gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed,
          **_given(args, "max_num_batched_tokens", "enable_prefix_caching"), enforce_eager=args.enforce_eager,
          kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales,
          logprobs_mode=args.logprobs_mode, tensor_parallel_size=args.tensor_parallel_size,
          scheduler=_scheduler(args),
          **({"speculative_config": args.speculative_config} if args.speculative_config else {}),
          **({"kv_transfer_config": args.kv_transfer_config} if args.kv_transfer_config else {}),
          **({"async_scheduling": True} if args.async_scheduling else {}))
    return 0


def _grade(args: argparse.Namespace) -> int:
    from minipaged.learn.grade import (
        exit_status,
        format_report,
        format_row,
        format_rubric,
        grade_report,
        gradescope_results,
        rows,
        write_results,
    )

    def progress(row: dict) -> None:  # each stage's line as soon as it is graded, on stderr
        print(format_row(rows({"stages": [row]})[0]), file=sys.stderr, flush=True)

    tests = Path(args.tests) if args.tests else None
    report = grade_report(Path(args.directory), args.stage, tests, collect_only=args.rubric,
                          progress=None if args.rubric else progress)
    if args.rubric:
        print(json.dumps(report["rubric"] | {"stages": report["stages"]}, indent=2) if args.json
              else format_rubric(report))
        return 0
    if args.output or args.format:
        data = gradescope_results(report) if args.format == "gradescope" else report
        path = write_results(Path(args.output or "results.json"), data, force=args.force)
        print(f"wrote {path}", file=sys.stderr)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return exit_status(report)


DEMO_PROMPTS = [
    "Return the number of", "This module provides", "Create a new", "The default value is",
    "If the file does not exist,", "Raise an exception if", "Convert the given", "This class implements",
    "Return True if the", "The optional argument", "Read and return", "Set the current",
]


def _scheduler(args: argparse.Namespace) -> str:
    """V1, as ``LLM()`` defaults to; V0 when asked (``--scheduler v0``), or for what only V0 serves: swap."""
    return getattr(args, "scheduler", None) or ("v0" if args.preemption_mode == "swap" else "v1")


def _engine_demo(args: argparse.Namespace) -> None:
    from minipaged import LLM, SamplingParams

    llm = LLM("tiny", scheduler=_scheduler(args), num_gpu_blocks=args.blocks, block_size=16, max_model_len=128,
              preemption_mode=args.preemption_mode, seed=0)  # V1; the paper's V0 to swap
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=0)
    print(f"{len(DEMO_PROMPTS)} prompts through the tiny model, in a KV cache of only {args.blocks} blocks "
          f"of 16 tokens ({args.blocks * 16} slots), preemption by {args.preemption_mode}:\n")
    outputs = llm.generate(DEMO_PROMPTS, [params] * len(DEMO_PROMPTS), use_tqdm=False)
    for out in outputs:
        print(f"  {out.prompt!r} -> {out.outputs[0].text.strip()[:90]!r}")
    stats = llm.stats
    lengths = [len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outputs]
    print("\nSummary")
    print(f"  peak KV memory in use:           {stats.peak_blocks_used} blocks = "
          f"{stats.peak_blocks_used * 16} token slots")
    print(f"  contiguous reservation would need {sum(lengths)} slots even with exact lengths (oracle), "
          f"{len(lengths) * llm.max_model_len} at max_model_len={llm.max_model_len} (max)")
    print(f"  KV utilisation (slots holding K/V among those in use): {100 * stats.kv_utilization:.1f}%")
    print(f"  preemptions: {stats.num_preemptions}, blocks swapped out: {stats.num_swapped_out_blocks}, "
          f"in: {stats.num_swapped_in_blocks}; {stats.steps} steps, {stats.prefill_tokens} prefill and "
          f"{stats.decode_tokens} decode tokens\n")


def _demo(args: argparse.Namespace) -> int:
    from minipaged.perf.simulate import (
        format_usage_table,
        simulate_contiguous,
        simulate_paged,
        synthetic_requests,
    )

    _set_threads(args)
    _engine_demo(args)
    requests = synthetic_requests(args.requests, rate=args.rate, seed=args.seed)
    print(f"Where the memory goes: {len(requests)} ShareGPT-like requests (mean prompt "
          f"{sum(r.prompt_len for r in requests) / len(requests):.0f}, mean output "
          f"{sum(r.output_len for r in requests) / len(requests):.0f} tokens), first come first served, in "
          f"{args.slots} token slots: contiguous slabs (stage 0) vs blocks of 16 served by the real engine loop and\n"
          f"scheduler (stages 6-7) with a runner that has no model:\n")
    results = [simulate_contiguous(requests, p, args.slots, 2048) for p in ("max", "pow2", "oracle")]
    results.append(simulate_paged(requests, args.slots // 16, 16))
    print(format_usage_table(results))
    print("\nOnly 'token' holds K/V; 'running' is the batch size that memory allows.")
    return 0


def _kernels(args: argparse.Namespace) -> int:
    from minipaged.perf.kernel_report import main as kernels

    return kernels(args.target.split(","), args.dtype.split(","), args.quick, args.json, args.no_divisibility)


def _generate(args: argparse.Namespace) -> int:
    from minipaged import LLM, SamplingParams

    _set_threads(args)
    llm = LLM(args.model, block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
              preemption_mode=args.preemption_mode, attention_backend=args.backend, dtype=args.dtype,
              device=args.device, gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed,
              scheduler=_scheduler(args), enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype,
              calculate_kv_scales=args.calculate_kv_scales,
              **_given(args, "max_num_batched_tokens", "enable_prefix_caching"))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    for out in llm.generate(args.prompt, [params] * len(args.prompt), use_tqdm=False):
        print(f"{out.prompt}{out.outputs[0].text}")
    return 0


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    """The engine's options that ``generate`` and ``serve`` share (``EngineConfig``'s names)."""
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-gpu-blocks", type=int,
                   help="KV blocks in the cache (default: what --gpu-memory-utilization leaves on CUDA, "
                        "256 MiB on a CPU)")
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                   help="what a preempted request loses: its K/V (recompute) or its place on the device (swap; v0)")
    p.add_argument("--attention-backend", "--backend", dest="backend", default="ref", choices=["ref", "triton"],
                   help="stage 4's PyTorch reference or stage 5's Triton kernels")
    p.add_argument("--dtype", default="float32", help="the weights' and the K/V's dtype")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="on CUDA: the share of the device's memory the engine may take (the K/V take what is left)")
    p.add_argument("--seed", type=int, default=0, help="the seed of the requests that name none")
    p.add_argument("--enable-prefix-caching", "--prefix-caching", dest="enable_prefix_caching",
                   action=argparse.BooleanOptionalAction,
                   help="reuse the K/V of shared prefixes (default: on under --scheduler v1, off under v0)")
    p.add_argument("--max-num-batched-tokens", type=int, help="the tokens one step may compute (the token budget)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: every step launched kernel by kernel (on CUDA with --attention-backend "
                        "triton, decode steps otherwise replay a graph)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="what the K/V cache stores: the model's dtype (auto) or e4m3, one byte a value (fp8)")
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="fp8: each layer's k_scale and v_scale from its first batch (else 1.0)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: the cores not busy now)")


def _add_learning_commands(sub) -> None:
    p = sub.add_parser("exercise", help="write a workspace where stage N's solutions are stubs")
    p.add_argument("stage", type=int, help="the stage whose solutions become stubs")
    p.add_argument("--out", help="folder to write (default: ./minipaged-exercise-N)")
    p.add_argument("--force", action="store_true", help="replace the folder if it exists")
    p.set_defaults(run=_exercise)

    p = sub.add_parser("grade", help="run the stage tests of a workspace and print a table")
    p.add_argument("directory", nargs="?", default=".", help="the exercise workspace")
    p.add_argument("--stage", type=int, action="append", help="grade only this stage (repeatable)")
    p.add_argument("--tests", metavar="DIR", help="a teacher's extra tests, run beside the workspace's own")
    p.add_argument("--json", action="store_true", help="print the whole report as JSON instead of the table")
    p.add_argument("--rubric", action="store_true", help="print the rubric: points per stage and per test")
    p.add_argument("--format", choices=["json", "gradescope"],
                   help="write the report to --output: as printed by --json, or as Gradescope's results.json")
    p.add_argument("--output", metavar="FILE", help="the file --format writes (default: ./results.json)")
    p.add_argument("--force", action="store_true", help="let --output replace a file this grader did not write")
    p.set_defaults(run=_grade)

    p = sub.add_parser("mutants", help="prove that each stage's tests catch its plausible wrong implementations")
    p.add_argument("--stage", type=int, action="append", help="only this stage's mutants (repeatable)")
    p.add_argument("--record", action="store_true",
                   help="keep each mutant's killing test, to run first next time (mutants_killed_by.json)")
    p.set_defaults(run=_mutants)

    p = sub.add_parser("kernels", help="compile stage 5's kernels for A100/H100 and read what the compiler made")
    p.add_argument("--target", default="sm_80,sm_90", help="comma-separated: sm_80 (A100), sm_90 (H100, H200)")
    p.add_argument("--dtype", default="bf16,fp16",
                   help="comma-separated: bf16, fp16, fp8 (bf16 queries over an e4m3 cache: sm_90 only)")
    p.add_argument("--quick", action="store_true", help="a few shapes instead of the whole table")
    p.add_argument("--json", help="also write the table to this file")
    p.add_argument("--no-divisibility", action="store_true",
                   help="compile as if no pointer or stride were a multiple of 16, to see what that costs")
    p.set_defaults(run=_kernels)


def _add_generate_command(sub) -> None:
    p = sub.add_parser("generate", help="generate text with a model")
    p.add_argument("--model", default="tiny", help="'tiny' or a local Hugging Face model folder")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (-1: all)")
    p.add_argument("--top-p", type=float, default=0.95, help="keep the most likely tokens up to this mass")
    _add_engine_options(p)
    p.set_defaults(run=_generate)


def _add_serve_command(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (loopback only)")
    p.add_argument("model", nargs="?", default="tiny", help="'tiny' or a local Hugging Face model folder")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    p.add_argument("--port", type=int, default=8000, help="the port to listen on (0: any free one)")
    p.add_argument("--max-waiting", type=int, default=256, help="requests that may wait; more get HTTP 503")
    p.add_argument("--max-model-len", type=int,
                   help="the longest sequence (default: the model's positions, or what the cache holds)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="the most sequences one step runs")
    _add_engine_options(p)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes (default: $VLLM_API_KEY)")
    p.add_argument("--served-model-name", help="the model's name in the API (default: the model argument)")
    p.add_argument("--shutdown-timeout", type=float, default=0.0,
                   help="on SIGTERM/SIGINT, seconds running requests may go on before they are aborted")
    p.add_argument("--max-logprobs", type=int, default=20, help="the most logprobs a request may ask for")
    p.add_argument("--logprobs-mode", default="raw_logprobs", choices=LOGPROBS_MODES,
                   help="what a sampled token's logprobs are: the model's (raw, the default) or those it was drawn "
                        "from (processed: after penalties, logit_bias, temperature, top-k/top-p); logprobs or logits")
    p.add_argument("--max-request-body-bytes", type=int, default=32 * 2**20, help="larger bodies get HTTP 413")
    p.add_argument("--request-read-timeout", type=float, default=30.0,
                   help="seconds a client has to send its whole body (else HTTP 408)")
    p.add_argument("--scheduler", choices=["v0", "v1"],
                   help="v1: stage 10's, vLLM V1's (one token budget per step, chunked prefill, prefix caching on "
                        "by default; the default); v0: the paper's (stage 6; the default with --preemption-mode "
                        "swap, which only v0 serves)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="V1's batch queue: schedule and launch each step before the one before is read")
    p.add_argument("--speculative-config", type=json.loads, metavar="JSON",
                   help='speculative decoding (V1), vLLM\'s speculative_config, e.g. '
                        '\'{"method": "ngram", "num_speculative_tokens": 4}\' (stage 12)')
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="worker processes that each hold a shard of the model and of every KV block (stage 11)")
    p.add_argument("--kv-transfer-config", type=json.loads, metavar="JSON",
                   help='disaggregated prefill, vLLM\'s kv_transfer_config, e.g. \'{"kv_connector": '
                        '"SharedStorageConnector", "kv_role": "kv_producer", "kv_connector_extra_config": '
                        '{"shared_storage_path": "kv_store"}}\' (stage 14)')
    p.set_defaults(run=_serve)


def _disagg_proxy(args: argparse.Namespace) -> int:
    from minipaged.serving.disagg_proxy import run_proxy

    run_proxy(args.prefill, args.decode, args.host, args.port)
    return 0


def _add_disagg_proxy_command(sub) -> None:
    p = sub.add_parser("disagg-proxy", help="one address in front of a prefill server and a decode server (stage 14)")
    p.add_argument("--prefill", required=True, help="the producer's URL, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", required=True, help="the consumer's URL, e.g. http://127.0.0.1:8200")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    p.add_argument("--port", type=int, default=8000, help="the port to listen on")
    p.set_defaults(run=_disagg_proxy)


def _add_demo_command(sub) -> None:
    p = sub.add_parser("demo", help="serve prompts in a tiny cache, then show where memory goes")
    p.add_argument("--blocks", type=int, default=8, help="KV cache blocks for the engine demo")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                   help="what a preempted request loses: its K/V (recompute, under V1) or its place on the device "
                        "(swap, under the paper's V0)")
    p.add_argument("--requests", type=int, default=300, help="requests of the memory simulation")
    p.add_argument("--slots", type=int, default=16384, help="KV slots of the memory simulation")
    p.add_argument("--rate", type=float, default=0.2, help="arrivals per decode step")
    p.add_argument("--seed", type=int, default=0, help="the simulation's seed")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="what the K/V cache stores: the model's dtype (auto) or e4m3, one byte a value (fp8)")
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="fp8: each layer's k_scale and v_scale from its first batch (else 1.0)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: the cores not busy now)")
    p.set_defaults(run=_demo)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Each option's default after its help, where it has one worth showing (not None, False or [])."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        shown = action.default not in (None, False, [], argparse.SUPPRESS) and "(default" not in help_text
        return f"{help_text} (default: %(default)s)" if shown and action.option_strings else help_text


def build_parser() -> argparse.ArgumentParser:
    from minipaged import __version__

    parser = argparse.ArgumentParser(prog="minipaged", description=__doc__)
    parser.add_argument("--version", action="version", version=f"minipaged {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_learning_commands(sub)
    _add_generate_command(sub)
    _add_serve_command(sub)
    _add_disagg_proxy_command(sub)
    _add_demo_command(sub)
    return parser


class _Parser(argparse.ArgumentParser):
    """A subcommand's parser: every option's default shown in its help."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, FileExistsError, FileNotFoundError) as err:
        print(f"minipaged {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
