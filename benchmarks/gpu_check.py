"""The GPU check: forerun's static base (slots, buckets, captured graphs) against transformers on one CUDA card.

Sections (each writes its records to `--out` as JSON lines as it goes, so a run cut short keeps what it measured):

- `smoke` (`gpu_smoke.py`): tiny random models of 4 families, fp32, eager and sdpa: greedy output of `plain`,
  `prompt_lookup`, `auto` and `eagle3` (a random head reading the layer the graph hands it) on the static base with
  graphs equals plain `model.generate`, token for token; the head's trees are counted (it drafts on replayed
  graphs); three ragged rows of a batch on the base's places, each equal to its own `model.generate`.
- `curve`: seconds per step by bucket: the captured step, the same step eager, and the growing-cache forward.
- `bench`: single-row greedy over prompts given as token ids (`--prompts`, from `benchmarks/gpu_prompts.py`):
  `model.generate` eager, `model.generate` with transformers' static cache (auto-compiled; warmed before timing),
  transformers' prompt lookup, and forerun methods, interleaved per prompt; every output checked against eager
  generate (bf16: a first difference must be a numerical tie on generate's own logits). Methods naming `eagle3`
  draft with `--draft-head` (the shipped `smollm2-135m` by default).
- `batch`: `generate([...])` of 1 / 4 / 16 rows (the static base's places) against transformers' batched
  generate, eager and static-cache compiled; `--batch-profile auto` runs `auto`'s batch once more under cProfile.
- `warm`: compiled buckets' warm-up for `max(--batch-rows)` rows, program by program (`gpu_warm.py`).
- `profile` (after `bench`, on its warm decoders): where a step's time goes (cProfile over 3 prompts, and the
  card's kernels and the host's CUDA calls per forward under torch.profiler over one).

Usage (on the GPU machine; `benchmarks/gpu_check.sh` prepares the model file and calls this):
    python benchmarks/gpu_check.py smoke,curve --model random-1b --out $OUT/gpu.jsonl
    python benchmarks/gpu_check.py curve,bench,batch --model .gpu/smollm2.gguf --prompts .gpu/prompts.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from gpu_smoke import head_graphs, smoke  # noqa: E402

from forerun import Decoder  # noqa: E402
from forerun.attention import pick_attention  # noqa: E402
from forerun.base.static import BUCKETS, StaticBase  # noqa: E402
from forerun.exactness import first_divergence  # noqa: E402
from forerun.latency import measure_curve, synchronize  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""A CPU run (no card) checks the script itself: the static base then runs eagerly."""


class Log:
    """Appends records to a JSON-lines file and echoes them."""

    def __init__(self, path: Path, deadline: float) -> None:
        self.path, self.deadline = path, deadline

    def __call__(self, section: str, **record: object) -> None:
        line = json.dumps({"section": section, **record}, default=str)
        print(line, flush=True)
        with self.path.open("a") as handle:
            handle.write(line + "\n")

    def late(self, margin: float = 0.0) -> bool:
        return time.monotonic() + margin > self.deadline


def sync_time(function) -> tuple[object, float]:
    synchronize(DEVICE)
    started = time.perf_counter()
    result = function()
    synchronize(DEVICE)
    return result, time.perf_counter() - started


def random_1b(tiny: bool = False, attention: str = "sdpa") -> tuple[torch.nn.Module, None]:
    """A randomly initialised bf16 model of Llama-3.2-1B's shape (its acceptance means nothing; its speed does);
    `tiny`: the same family a thousand times smaller, to check the script without a card."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        tie_word_embeddings=True,
    )  # fmt: skip
    if tiny:
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=1024)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.config._attn_implementation = pick_attention(attention, DEVICE.type, torch.bfloat16)
    return model.eval(), None


def curve(log: Log, model: torch.nn.Module, label: str) -> None:
    captured = StaticBase(model)  # graphs on a card
    started = time.perf_counter()
    graphs = captured.measure_curve()
    eager = StaticBase(model, graphs=False).measure_curve()
    growing = measure_curve(model, sizes=BUCKETS)
    log("curve", model=label, capture_and_measure_s=round(time.perf_counter() - started, 2))
    for size in BUCKETS:
        log(
            "curve",
            model=label,
            bucket=size,
            captured_ms=round(graphs.cost(size) * 1e3, 3),
            static_eager_ms=round(eager.cost(size) * 1e3, 3),
            growing_eager_ms=round(growing.cost(size) * 1e3, 3),
            captured_relative=round(graphs.cost(size) / graphs.cost(1), 3),
        )
    log("curve", model=label, graph_capture_s=round(captured.capture_seconds, 3), capture_error=captured.capture_error)


def steps(log: Log, model, label: str, new_tokens: int = 64) -> None:
    """Undrafted decoding of one random prompt: transformers eager, transformers' compiled static cache (warmed),
    forerun `plain` on captured graphs; tokens per second, interleaved twice (acceptance plays no part)."""
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, 128), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    decoder = Decoder(model, None, "plain", static_cache=True)
    fused = Decoder(model, None, "plain", static_cache=True, compile_buckets=True)
    hf_generate(model, ids, 8)
    _, compile_s = sync_time(lambda: hf_generate(model, ids, new_tokens, cache_implementation="static"))
    decoder.generate(ids, 8)
    _, fused_s = sync_time(lambda: fused.generate(ids, 8))
    log("steps", model=label, note="warmed", static_compile_s=round(compile_s, 1), buckets_compile_s=round(fused_s, 1))
    runs = {
        "generate": lambda: hf_generate(model, ids, new_tokens, min_new_tokens=new_tokens),
        "generate_static_compiled": lambda: hf_generate(
            model, ids, new_tokens, cache_implementation="static", min_new_tokens=new_tokens
        ),
        "forerun_plain": lambda: decoder.generate(ids, new_tokens, eos_token_id=[]),
        "forerun_plain_compiled": lambda: fused.generate(ids, new_tokens, eos_token_id=[]),
    }
    for round_ in range(2):
        for name, run in runs.items():
            _, took = sync_time(run)
            log("steps", model=label, round=round_, method=name, tokens_per_s=round(new_tokens / took, 1),
                ms_per_token=round(1e3 * took / new_tokens, 3))  # fmt: skip


def head_costs_ms(decoder: Decoder) -> dict[str, dict[int, float]] | None:
    """What the decoder's EAGLE-3 head's forwards are priced at by rows (ms; measured when it was made), or None
    where they are not priced (no head, or steps timed rather than priced)."""
    costs = [d.costs for d in decoder.drafters if getattr(d, "costs", None) is not None]
    if not costs:
        return None
    return {kind: {n: round(curve.cost(n) * 1e3, 3) for n in curve.sizes}
            for kind, curve in (("level", costs[0].level), ("read", costs[0].read))}  # fmt: skip


def curve_ms(decoder: Decoder) -> dict[int, float] | None:
    """The decoder's priced step cost per bucket (ms), where its budget is the cost model."""
    curve = getattr(decoder.budget, "curve", None)
    return None if curve is None else {size: round(curve.cost(size) * 1e3, 3) for size in BUCKETS}


def hf_generate(model, ids, new_tokens: int, **kwargs):
    kwargs.setdefault("min_new_tokens", 0)
    return model.generate(ids, max_new_tokens=new_tokens, do_sample=False, **kwargs)


def bench(
    log: Log,
    model,
    tokenizer,
    prompts: list[dict],
    new_tokens: int,
    methods: list[str],
    compiled: list[str],
    baselines: list[str],
    head: str | None = None,
) -> dict[str, Decoder]:
    """Interleaved single-row runs; speed ratios against eager generate and compiled static-cache generate.
    `compiled`: these methods also with their buckets compiled before capture (label `METHOD (compiled)`);
    `baselines`: transformers' runs beside eager generate (`generate_static_compiled`, `hf_prompt_lookup`).
    `head`: the EAGLE-3 head of methods naming `eagle3`. Returns the warmed decoders by label (the profile reuses
    them: no second compile)."""
    longest = max(prompts, key=lambda p: len(p["ids"]))
    warm_ids = torch.tensor([longest["ids"]], device=DEVICE)
    labels = [(m, m, False) for m in methods] + [(f"{m} (compiled)", m, True) for m in compiled]
    decoders = {label: warmed(log, model, tokenizer, method, fused, head, len(longest["ids"]) + new_tokens)
                for label, method, fused in labels}  # fmt: skip
    if "generate_static_compiled" in baselines:
        _, compile_s = sync_time(lambda: hf_generate(model, warm_ids, new_tokens, cache_implementation="static"))
        hf_generate(model, warm_ids, new_tokens, cache_implementation="static")
        log("bench", note="static-cache generate warmed (compile)", seconds=round(compile_s, 1))
    for decoder in decoders.values():
        decoder.generate(warm_ids, 16)
    from forerun.cli.common import freeze_start_up

    freeze_start_up()  # as a served process starts: no full collection walks what compiling left in a timed run
    for prompt in prompts:
        if log.late(60):
            log("bench", note="deadline: stopped early")
            return decoders
        bench_prompt(log, model, prompt, new_tokens, decoders, baselines)
    return decoders


def warmed(log: Log, model, tokenizer, method: str, fused: bool, head: str | None, max_len: int) -> Decoder:
    """A static-cache decoder of `method` (its buckets compiled where `fused`; `head` where it names eagle3), every
    bucket captured up to `max_len` before any timing; what making and warming it took is logged."""
    label = f"{method} (compiled)" if fused else method
    drafts_with = head if "eagle3" in method.split("+") else None
    decoder, made_s = sync_time(
        lambda: Decoder(model, tokenizer, method, static_cache=True, compile_buckets=fused, draft_head=drafts_with)
    )
    warm_s = decoder.warm_up(max_len)
    log("bench", note=f"{label}: made (curve measured or loaded) and warmed", made_s=round(made_s, 1),
        warm_s=round(warm_s, 1), capture_s=round(decoder.base.capture_seconds, 1),
        capture_error=decoder.base.capture_error, curve_ms=curve_ms(decoder),
        graph_features=list(decoder.base.features), head_graphs=head_graphs(decoder),
        head_costs_ms=head_costs_ms(decoder))  # fmt: skip
    return decoder


def bench_prompt(
    log: Log, model, prompt: dict, new_tokens: int, decoders: dict[str, Decoder], baselines: list[str]
) -> None:
    """One prompt through eager generate (the reference, its logits kept), the `baselines` and every decoder; one
    record each: its speed, and whether its text is generate's (or differs first at a tie)."""
    ids = torch.tensor([prompt["ids"]], device=DEVICE)
    out, seconds = sync_time(
        lambda: hf_generate(model, ids, new_tokens, output_logits=True, return_dict_in_generate=True)
    )
    reference = out.sequences[0, ids.shape[1] :].tolist()
    logits = [row[0] for row in out.logits]
    rows = {"generate": (reference, seconds, None)}
    runs = {
        "generate_static_compiled": lambda: hf_generate(model, ids, new_tokens, cache_implementation="static"),
        "hf_prompt_lookup": lambda: hf_generate(model, ids, new_tokens, prompt_lookup_num_tokens=10),
    }
    for label, run in [(label, run) for label, run in runs.items() if label in baselines]:
        result, took = sync_time(run)
        rows[label] = (result[0, ids.shape[1] :].tolist(), took, None)
    for method, decoder in decoders.items():
        result, took = sync_time(lambda d=decoder: d.generate(ids, new_tokens))
        rows[method] = (result.new_tokens, took, result.stats)
    for label, (tokens, took, stats) in rows.items():
        divergence = first_divergence(reference, tokens, logits, model.dtype)
        log("bench", prompt=prompt["id"], dataset=prompt["dataset"], method=label, new_tokens=len(tokens),
            seconds=round(took, 4), tokens_per_s=round(len(tokens) / took, 1), identical=divergence is None,
            tie=None if divergence is None else divergence.is_tie, **step_figures(stats))  # fmt: skip


def step_figures(stats) -> dict:
    """A decoder's figures per step (none for transformers' runs, `stats` None)."""
    if stats is None:
        return {}
    steps = max(stats.forwards, 1)
    return {
        "tokens_per_forward": round(stats.tokens_per_forward, 3),
        "forwards": stats.forwards,
        "fed_per_forward": round(stats.fed_tokens / steps, 2),
        "host_ms_per_step": round(1e3 * stats.draft_seconds / steps, 3),
        "forward_ms_per_step": round(1e3 * stats.forward_seconds / steps, 3),
        "prefill_ms": round(1e3 * stats.prefill_seconds, 2),
    }


def log_slow_collections(log: Log, threshold_s: float = 0.05) -> None:
    """Record every garbage collection longer than `threshold_s` (its generation and seconds): compiling leaves
    millions of objects behind, and one full collection among them may hold a step (a suspect for one compiled
    prompt's 1.7 s first step on the H200)."""
    import gc

    started: dict[str, float] = {}

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started["at"] = time.perf_counter()
        elif "at" in started and (seconds := time.perf_counter() - started.pop("at")) > threshold_s:
            log("gc", generation=info.get("generation"), seconds=round(seconds, 3), collected=info.get("collected"))

    gc.callbacks.append(timed)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sections", help="comma-separated: smoke, curve, steps, bench, batch, profile, warm")
    parser.add_argument("--model", default="random-1b", help="random-1b, random-tiny (a check), or a .gguf file")
    parser.add_argument("--prompts", type=Path, help="JSON list of {id, dataset, ids}")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--methods", default="plain,prompt_lookup,trie,auto")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument(
        "--attention",
        default="sdpa",
        help="sdpa (transformers' own, every figure so far) or "
        "forerun_sdpa (grouped heads read in place; the baselines share the model, so they run it too)",
    )
    parser.add_argument("--compiled", default="", help="bench: these methods with compiled buckets too (a list)")
    parser.add_argument("--baselines", default="generate_static_compiled,hf_prompt_lookup",
                        help="bench: transformers' runs beside eager generate")  # fmt: skip
    parser.add_argument("--batch-compiled", default="", help="batch: these methods with compiled buckets too")
    parser.add_argument("--batch-rows", default=[1, 4, 16], type=row_counts, help="batch: the batch sizes (e.g. 4,16)")
    parser.add_argument("--batch-baselines", default="generate_static_compiled",
                        help="batch: transformers' runs beside its eager batched generate (none: '')")  # fmt: skip
    parser.add_argument("--batch-steered", default="",
                        help="batch: these methods also steered by timings (reproducible=False)")  # fmt: skip
    parser.add_argument("--batch-profile", default="",
                        help="batch: these runs once more under cProfile (e.g. auto)")  # fmt: skip
    parser.add_argument("--profile", default="auto,prompt_lookup",
                        help="profile: the bench's decoders of these methods (compiled or not)")  # fmt: skip
    parser.add_argument("--draft-head", default="smollm2-135m",
                        help="bench: the EAGLE-3 head of methods naming eagle3 (a folder, a shipped name)")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting new work after this long")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.jsonl"))
    return parser.parse_args()


def main() -> None:
    args = arguments()
    log = Log(args.out, time.monotonic() + args.budget_s)
    log_slow_collections(log)
    import transformers

    from forerun.measured import device_name

    log("env", torch=torch.__version__, transformers=transformers.__version__, device=device_name(DEVICE))
    sections = args.sections.split(",")
    if "smoke" in sections:
        guarded(log, "smoke", lambda: smoke(log, DEVICE))
    if not {"curve", "bench", "batch", "steps", "profile", "warm"} & set(sections):
        return
    if args.model in ("random-1b", "random-tiny"):
        model, tokenizer = random_1b(args.model == "random-tiny", args.attention)
        label = "random Llama-3.2-1B shape, bf16" if args.model == "random-1b" else "random tiny llama, bf16"
    else:
        from forerun.models import load_model

        device = str(DEVICE)
        model, tokenizer = load_model(args.model, dtype=args.dtype, device=device, attn_implementation=args.attention)
        label = f"{Path(args.model).name}, {args.dtype}"
    if "curve" in sections:
        guarded(log, "curve", lambda: curve(log, model, label))
    if "steps" in sections:
        guarded(log, "steps", lambda: steps(log, model, label))
    if "warm" in sections:
        from gpu_warm import warm_programs

        guarded(log, "warm", lambda: warm_programs(log, model, max(args.batch_rows)))
    prompts = json.loads(args.prompts.read_text()) if args.prompts else []
    decoders: dict[str, Decoder] = {}
    if "bench" in sections and prompts:
        methods = [m for m in args.methods.split(",") if m]
        compiled, baselines = [m for m in args.compiled.split(",") if m], args.baselines.split(",")
        made = guarded(log, "bench", lambda: bench(log, model, tokenizer, prompts, args.new_tokens, methods,
                                                   compiled, baselines, args.draft_head))  # fmt: skip
        decoders.update(made or {})
    if "profile" in sections and prompts:
        from gpu_profile import profile

        wanted = [m for m in args.profile.split(",") if m]
        chosen = {label: d for label, d in decoders.items() if not wanted or label.split(" ")[0] in wanted}
        guarded(log, "profile", lambda: profile(log, model, tokenizer, prompts, args.new_tokens, chosen))
    if "batch" in sections and prompts:
        from gpu_batch import batch

        compiled = [m for m in args.batch_compiled.split(",") if m]
        guarded(log, "batch", lambda: batch(log, model, tokenizer, prompts, min(args.new_tokens, 64), compiled,
                                            args.batch_rows, args.batch_baselines.split(","),
                                            tuple(m for m in args.batch_profile.split(",") if m),
                                            tuple(m for m in args.batch_steered.split(",") if m)))  # fmt: skip


def row_counts(text: str) -> list[int]:
    """`--batch-rows`: comma-separated positive row counts, refused by argparse with the value named otherwise."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or any(count < 1 for count in counts):
        raise argparse.ArgumentTypeError(f"expected positive row counts such as 4,16, got {text[:40]!r}")
    return counts


def guarded(log: Log, section: str, run):
    """Run one section and return what it returns (None where it failed: the failure is recorded and the next
    section still runs)."""
    if log.late():
        log(section, note="skipped: deadline")
        return None
    try:
        return run()
    except Exception as error:  # noqa: BLE001 - a device check reports every failure and goes on
        import traceback

        log(section, error=f"{type(error).__name__}: {error}", trace=traceback.format_exc()[-3000:])


if __name__ == "__main__":
    main()
