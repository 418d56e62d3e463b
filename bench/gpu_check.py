"""One command that verifies and measures the gpt-oss engine on a lent GPU (issue 45).

Four steps, each recorded as JSON lines (one per figure) on stdout and in ``--out``
(default ``$OUT/gpu_check.jsonl`` where ``OUT`` is set, else the system's temp folder). A step
that fails or raises is recorded (``"status": "failed"`` or ``"error"``, with the message) and
the next one runs; the exit status is 1 if any record failed or raised, 0 otherwise.

1. **Kernel tests**: ``pytest tests/test_triton_*.py`` in a subprocess, ``TRITON_INTERPRET``
   unset: passed / failed / skipped and the first failure's message. (These tests run the
   kernels in Triton's interpreter on CPU tensors by design, plus ``test_triton_compile``'s
   offline sm_90 build: on the device they check the device's own torch and Triton versions;
   the compiled kernels on the GPU are checked by step 2.)
2. **Correctness** at gpt-oss-20b's exact shapes, 4 layers, random MXFP4 experts, bf16: the
   Triton path against the torch reference path (``ops.TORCH``) in the same model: max relative
   error (``max|triton - torch| / max|torch|``) of the residual stream after each layer and of the
   logits (goal 2e-2); greedy tokens of 3 prompts over 32 steps (identical, or a first
   divergence within the two paths' own logit difference at that step: a bf16 tie); the
   fixed-shape (padded bucket) decode's tokens; CUDA-graph replay's tokens against eager.
3. **Speed**, 24 layers of 20b shapes (``bench/inference.py``'s random model and timed run):
   decode tok/s at batch 1, 32 and 128, eager and CUDA graph; prefill tok/s; launches per decode
   step; the batch-1 fraction of the memory-bandwidth roofline from the bytes a step reads (goal
   60%); batch 128 against 10,000 tok/s; the Triton / torch decode ratio at batch 1.
4. **MoE tuning sweep** (``kernels/moe_tune.py``) on a few token counts at 20b shapes, only in
   the time left; the best entries are also written beside ``--out`` (``gpu_check.moe_tuned.json``) for
   ``triton_moe.load_tuned_configs``.

Every step checks the time budget (``--budget-s``, default 420 s) before each unit of work and
records what it had to leave out (``"status": "skipped"``, ``"reason": "budget"``); the sweep
comes last and only runs in what is left.

On the device (one ``run`` call, ``timeout_s`` 480; the machine has no network and needs no
install: the script maps the package ``refinery`` onto this checkout itself when it is not
installed)::

    PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --out $OUT/gpu_check.jsonl 2>&1 | tee $OUT/gpu_check.log

then commit the file from the reply's ``files_at`` as ``bench/results/gpu_check-<kind>-<date>.jsonl``
(its first record, ``"name": "machine"``, holds the GPU's name; add the reply's ``device`` line)
and put the figures in docs/PERFORMANCE.md. A rerun of some steps only: ``--steps 2,3``.

``--dry-run`` runs the same steps at tiny shapes on the CPU, the Triton kernels in Triton's
interpreter (``TRITON_INTERPRET=1``), float32, a fast subset of the kernel tests, in under a
minute; the CUDA-graph figures are recorded as skipped (no CUDA device), the timings mean
nothing. It needs only torch, triton, numpy, safetensors and pytest (no Beam, no pyarrow)::

    .venv/bin/python bench/gpu_check.py --dry-run --out /tmp/gpu_check_dry.jsonl
"""
from __future__ import annotations

import argparse
import copy
import gc
import importlib
import importlib.util
import json
import math
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
import traceback
import types
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]


def import_refinery(root: Path = ROOT) -> str:
    """Make ``refinery`` importable as this checkout: ``"installed"`` when an install (``pip
    install -e .``) already maps it here, ``"checkout"`` when it was not installed and is now
    mapped onto ``root`` (the checkout's root is the package: setup.py's package_dir). An
    install of another checkout is an error: its code is not the code under test."""
    try:
        kernels = importlib.import_module("refinery.kernels")
    except ModuleNotFoundError as e:
        if e.name not in ("refinery", "refinery.kernels"):
            raise
        for name in [n for n in sys.modules if n == "refinery" or n.startswith("refinery.")]:
            del sys.modules[name]
        package = types.ModuleType("refinery")
        package.__path__ = [str(root)]
        sys.modules["refinery"] = package
        importlib.import_module("refinery.kernels")
        return "checkout"
    found = Path(kernels.__file__ or "").resolve().parent
    if found != (root / "kernels").resolve():
        raise SystemExit(f"bench/gpu_check.py: the installed refinery is {found.parent}, not this checkout {root}; "
                         f"run it from that checkout or uninstall it")
    return "installed"


REFINERY_SOURCE = import_refinery()

import torch  # noqa: E402

from refinery.kernels import ops  # noqa: E402
from refinery.kernels.batching import BatchedGenerator, sample  # noqa: E402
from refinery.kernels.config import ModelConfig  # noqa: E402
from refinery.kernels.model import Transformer  # noqa: E402


def load_bench_inference() -> types.ModuleType:
    """``bench/inference.py`` as a module (its random model, timed run, byte counts, roofline)."""
    name = "refinery_bench_inference"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "inference.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {ROOT / 'bench' / 'inference.py'}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


bench = load_bench_inference()

# ---- settings ----------------------------------------------------------------------------

GPU_TESTS = ["tests/test_triton_*.py"]  # a glob, expanded against the checkout
# the dry run's subset (the whole set takes minutes under the interpreter on a small CPU)
DRY_RUN_TESTS = [
    "tests/test_triton_fused.py",
    "tests/test_triton_moe.py::test_route_matches_topk_softmax",
    "tests/test_triton_moe.py::test_moe_bfloat16_and_registry_wrapper",
    "tests/test_triton_attention.py::test_sink_effect",
    "tests/test_triton_bench.py::test_byte_counts",
]
LOGITS_REL_TOL = 2e-2  # the goal for bf16
FLOAT32_REL_TOL = 1e-4  # Triton against torch in float32, where no expert choice flips
ROOFLINE_GOAL = 0.6  # batch-1 decode, fraction of the peak memory bandwidth
# peak HBM bandwidth (TB/s) by the name torch reports; the first match wins
PEAK_TBPS = (("H200", 4.8), ("H100 PCIe", 2.0), ("H100", 3.35))


@dataclass
class Plan:
    """The shapes and sizes of a run: the GPU's (issue 45) or the dry run's (tiny, CPU)."""

    dry_run: bool
    dtype: torch.dtype
    tests: list[str]
    tests_timeout_s: float
    check_shapes: dict[str, Any]  # step 2's ModelConfig fields
    check_prompt_len: int  # the forward pass compared layer by layer
    greedy_prompt_lens: list[int]
    greedy_steps: int
    speed_shapes: dict[str, Any]  # step 3
    batches: list[int]
    prompt_len: int
    new_tokens: int
    prefill_chunk: int
    baseline_tokens: int
    launch_batches: list[int]
    copy_gb: float
    sweep_shapes: dict[str, int]  # step 4: hidden, inter, num_experts, topk
    sweep_tokens: list[int]
    sweep_configs: list[dict[str, int]] = field(default_factory=list)
    sweep_repeats: int = 20


def make_plan(args: argparse.Namespace) -> Plan:
    if args.dry_run:
        tiny = dict(bench.SHAPES["tiny"])
        plan = Plan(
            dry_run=True, dtype=torch.float32, tests=DRY_RUN_TESTS, tests_timeout_s=120,
            # 2 layers: one sliding, one full; a prompt past the window
            check_shapes={**tiny, "num_hidden_layers": 2}, check_prompt_len=tiny["sliding_window"] + 5,
            greedy_prompt_lens=[5, 10, 7], greedy_steps=4,
            speed_shapes={**tiny, "num_hidden_layers": 2}, batches=[1, 2], prompt_len=10, new_tokens=3,
            prefill_chunk=32, baseline_tokens=3,
            launch_batches=[1, 2], copy_gb=0.01,
            sweep_shapes=dict(hidden=64, inter=64, num_experts=4, topk=2), sweep_tokens=[2],
            sweep_configs=[dict(block_m=16, block_n=32, block_k=64, split_k=1),
                           dict(block_m=16, block_n=32, block_k=32, split_k=2)],
            sweep_repeats=1,
        )
    else:
        twenty = dict(bench.SHAPES["20b"])
        plan = Plan(
            dry_run=False, dtype=torch.bfloat16, tests=GPU_TESTS, tests_timeout_s=150,
            check_shapes={**twenty, "num_hidden_layers": 4}, check_prompt_len=512,
            greedy_prompt_lens=[37, 200, 129], greedy_steps=32,
            speed_shapes=twenty, batches=[1, 32, 128], prompt_len=1024, new_tokens=128, prefill_chunk=8192,
            baseline_tokens=16, launch_batches=[1, 32], copy_gb=2.0,
            # batch 1 and 128 first (the goals' batches), each over 24 tilings (about a minute)
            sweep_shapes=dict(hidden=2880, inter=2880, num_experts=32, topk=4), sweep_tokens=[1, 128, 32, 1024],
            sweep_configs=[dict(block_m=m, block_n=n, block_k=k, split_k=s, num_warps=4 if m <= 32 else 8)
                           for m in (16, 32, 64) for n in (64, 128) for k in (64, 128) for s in (1, 2)],
        )
    if args.batches:
        plan.batches = args.batches
    if args.new_tokens:
        plan.new_tokens = args.new_tokens
    if args.prompt_len:
        plan.prompt_len = args.prompt_len
    return plan


# ---- records -----------------------------------------------------------------------------


class Recorder:
    """Writes each record as one JSON line to stdout and to ``path`` (flushed at once, so a run
    cut off by its time limit keeps what it measured)."""

    def __init__(self, path: Path, common: dict[str, Any]) -> None:
        self.path, self.common = path, common
        self.records: list[dict[str, Any]] = []
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("w")

    def __call__(self, step: int, name: str, status: str, **figures: Any) -> dict[str, Any]:
        record = {"step": step, "name": name, "status": status, **self.common, **figures}
        line = json.dumps(record, default=_jsonable)
        self.records.append(json.loads(line))
        print(line, flush=True)
        self._file.write(line + "\n")
        self._file.flush()
        return record

    def close(self) -> None:
        self._file.close()


def _jsonable(value: Any) -> Any:
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def error_figures(exc: BaseException) -> dict[str, Any]:
    """What an ``"error"`` record says about an exception: its one-line message and where it was raised."""
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    return {"error": f"{type(exc).__name__}: {exc}"[:2000],
            "where": [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames]}


class Budget:
    """The run's time limit; each unit of work asks before it starts."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start = seconds, time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)

    def allows(self, needed_s: float) -> bool:
        return self.left() >= needed_s


# ---- pure helpers (tested without a GPU) ---------------------------------------------------


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|got - ref| / max|ref|`` in float64 (0 when both are all zero)."""
    got64, ref64 = got.double(), ref.double()
    scale = ref64.abs().max().item()
    diff = (got64 - ref64).abs().max().item()
    return diff / scale if scale else (0.0 if diff == 0 else math.inf)


def first_divergence(ref: Sequence[Sequence[int]], got: Sequence[Sequence[int]]) -> tuple[int, int] | None:
    """(prompt, step) of the first token where ``got`` leaves ``ref`` (the lowest step over all
    prompts; a length difference counts at the shorter one's end), or None if identical."""
    found: tuple[int, int] | None = None
    if len(ref) != len(got):
        raise ValueError(f"{len(ref)} reference sequences against {len(got)}")
    for p, (r, g) in enumerate(zip(ref, got)):
        step = next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), None)
        if step is None and len(r) != len(g):
            step = min(len(r), len(g))
        if step is not None and (found is None or step < found[1]):
            found = (p, step)
    return found


def tie_figures(ref_row: torch.Tensor, got_row: torch.Tensor, ref_token: int, got_token: int) -> dict[str, Any]:
    """Whether a greedy divergence is a tie: at the step where the tokens first differ (same
    prefix, so comparable logits), the reference's margin between its token and the other
    path's is within twice the two paths' largest logit difference at that step."""
    ref64, got64 = ref_row.double(), got_row.double()
    margin = (ref64[ref_token] - ref64[got_token]).item()
    step_diff = (got64 - ref64).abs().max().item()
    return {"ref_margin": margin, "logit_diff_at_step": step_diff,
            "logit_scale": ref64.abs().max().item(), "explained_by_tie": margin <= 2 * step_diff}


PYTEST_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)")


def pytest_counts(junit_xml: str | None, output: str) -> dict[str, Any]:
    """passed / failed / skipped / errors and the first failure, from pytest's JUnit XML (None
    when pytest did not finish writing it: then from the progress characters it printed)."""
    if junit_xml:
        root = ET.fromstring(junit_xml)
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        total = sum(int(s.get("tests", 0)) for s in suites)
        failed = sum(int(s.get("failures", 0)) for s in suites)
        errors = sum(int(s.get("errors", 0)) for s in suites)
        skipped = sum(int(s.get("skipped", 0)) for s in suites)
        first = None
        for case in root.iter("testcase"):
            bad = case.find("failure")
            if bad is None:
                bad = case.find("error")
            if bad is not None:
                lines = (bad.text or "").strip().splitlines()
                message = bad.get("message") or (lines[-1] if lines else "")
                first = f"{case.get('classname')}::{case.get('name')}: {message}"[:2000]
                break
        return {"passed": total - failed - errors - skipped, "failed": failed, "errors": errors,
                "skipped": skipped, "first_failure": first}
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for line in output.splitlines():
        progress = re.fullmatch(r"([.FEsxX]+)\s*(\[\s*\d+%\])?", line.strip())
        if progress:
            chars = progress.group(1)
            counts["passed"] += chars.count(".") + chars.count("X")
            counts["failed"] += chars.count("F")
            counts["errors"] += chars.count("E")
            counts["skipped"] += chars.count("s") + chars.count("x")
    return {**counts, "first_failure": None}


def peak_bandwidth(device_name: str, override_tbps: float | None) -> tuple[float, str]:
    """(bytes/s, where the figure comes from) of the GPU's HBM."""
    if override_tbps:
        return override_tbps * 1e12, "--peak-tbps"
    for key, tbps in PEAK_TBPS:
        if key in device_name:
            return tbps * 1e12, f"{key} datasheet"
    return bench.H100_PEAK_TBPS * 1e12, f"unknown GPU {device_name!r}: the H100 SXM's figure"


def config_for(shapes: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**shapes)


# ---- the run -----------------------------------------------------------------------------


@dataclass
class Context:
    args: argparse.Namespace
    plan: Plan
    device: torch.device
    kernels: ops.Kernels  # the Triton set (compiled on CUDA, interpreted on the CPU)
    record: Recorder
    budget: Budget


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def run_unit(ctx: Context, step: int, name: str, needed_s: float, fn: Callable[[], None]) -> None:
    """``fn()`` (which records its own figures) if the budget allows ``needed_s`` (the unit's
    time on the GPU; a dry run's units take a second or two), else a skipped record; an
    exception becomes an ``"error"`` record and the run goes on."""
    if ctx.plan.dry_run:
        needed_s = min(needed_s, 2.0)
    if not ctx.budget.allows(needed_s):
        ctx.record(step, name, "skipped", reason="budget", needed_s=needed_s, left_s=round(ctx.budget.left(), 1))
        return
    t = time.perf_counter()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - recorded; the next unit runs
        ctx.record(step, name, "error", seconds=round(time.perf_counter() - t, 2), **error_figures(e))


# -- step 1 ---------------------------------------------------------------------------------


def _test_paths(patterns: list[str]) -> list[str]:
    out: list[str] = []
    for pattern in patterns:
        file, _, test = pattern.partition("::")
        matches = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(file)) if "*" in file else [file]
        out += [m + (f"::{test}" if test else "") for m in matches]
    return out


def kernel_tests(ctx: Context) -> None:
    tests = _test_paths(ctx.plan.tests)
    env = {k: v for k, v in os.environ.items()
           if k != "TRITON_INTERPRET" and not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        if REFINERY_SOURCE == "checkout":  # the tests import refinery: map it onto the checkout there too
            (Path(tmp) / "refinery").symlink_to(ROOT, target_is_directory=True)
            env["PYTHONPATH"] = os.pathsep.join([tmp] + [p for p in [env.get("PYTHONPATH")] if p])
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *tests]
        if not ctx.plan.dry_run and importlib.util.find_spec("xdist") is not None:
            cmd[4:4] = ["-n", "4", "--dist", "loadfile"]
        timeout = min(ctx.plan.tests_timeout_s, max(10.0, ctx.budget.left() - 30))
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            output, rc, timed_out = proc.stdout + proc.stderr, proc.returncode, False
        except subprocess.TimeoutExpired as e:
            output = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            rc, timed_out = None, True
        seconds = round(time.perf_counter() - t, 1)
        xml = junit.read_text() if junit.exists() and not timed_out else None
    counts = pytest_counts(xml, output)
    ok = not timed_out and rc == 0 and counts["failed"] == 0 and counts["errors"] == 0 and counts["passed"] > 0
    tail = output.strip().splitlines()[-1:] if output.strip() else []
    ctx.record(1, "kernel_tests", "ok" if ok else "failed", tests=tests, interpreter_forced_by_tests=True,
               returncode=rc, timed_out=timed_out, seconds=seconds, **counts, last_line=tail[0] if tail else None)


# -- step 2 ---------------------------------------------------------------------------------


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy(model: Transformer, prompts: list[list[int]], steps: int, cuda_graph: bool = False,
           keep_logits: bool = False) -> tuple[list[list[int]], list[list[torch.Tensor]], BatchedGenerator]:
    """Greedy tokens of each prompt (all in one batch), the logits each was chosen from (CPU,
    float32) when ``keep_logits``, and the generator (its CUDA-graph counters)."""
    gen = BatchedGenerator(model, max_seq_len=max(map(len, prompts)) + steps, max_batch=len(prompts),
                           prefill_chunk=max(map(len, prompts)), cuda_graph=cuda_graph)
    ids = [gen.add(p, max_tokens=steps) for p in prompts]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    logits_of: dict[int, list[torch.Tensor]] = {i: [] for i in ids}
    while not gen.idle:
        stepped = gen.step()
        if stepped is None:
            raise RuntimeError(f"the generator stalled with {sum(map(len, tokens.values()))} tokens generated")
        logits, seq_ids = stepped
        chosen = sample(logits, 0.0)
        rows = logits.float().cpu() if keep_logits else None
        for b, (sid, token) in enumerate(zip(seq_ids, chosen)):
            tokens[sid].append(token)
            if rows is not None:
                logits_of[sid].append(rows[b])
            gen.update(sid, token)
    return [tokens[i] for i in ids], [logits_of[i] for i in ids], gen


def compare_tokens(ref: list[list[int]], got: list[list[int]], ref_logits: list[list[torch.Tensor]],
                   got_logits: list[list[torch.Tensor]]) -> tuple[bool, dict[str, Any]]:
    """(passes, figures): identical tokens pass; a first divergence passes when it is a tie."""
    where = first_divergence(ref, got)
    if where is None:
        return True, {"identical": True}
    p, s = where
    figures: dict[str, Any] = {"identical": False, "first_divergence": {"prompt": p, "step": s},
                               "matching_prefix": [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r))
                                                   for r, g in zip(ref, got)]}
    if s < len(ref[p]) and s < len(got[p]) and ref_logits and got_logits:
        figures.update(tie_figures(ref_logits[p][s], got_logits[p][s], ref[p][s], got[p][s]))
        return bool(figures["explained_by_tie"]), figures
    return False, figures


def spy_routes(kernels: ops.Kernels, store: list[torch.Tensor]) -> ops.Kernels:
    """``kernels`` whose ``route`` also appends each call's chosen experts (sorted per row) to ``store``."""
    route = kernels.route

    def spied(router_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        indices, weights = route(router_logits, k)
        store.append(torch.sort(indices, dim=-1).values.clone())
        return indices, weights

    return kernels.replace(name=kernels.name, route=spied)


def logits_by_routing(model: Transformer, kernels: ops.Kernels, tokens: torch.Tensor) -> dict[str, Any]:
    """Triton's logits against torch's, split by whether a token's expert choice flipped.

    A rounding difference in front of the router can move a token to another expert (top-k of
    32), and from there the token's stream differs by whole expert outputs: the max-norm error
    over all tokens then measures routing ties, not the kernels. The tokens before the first flip
    see identical experts in every layer; their error is the kernels' own."""
    ref_routes: list[torch.Tensor] = []
    got_routes: list[torch.Tensor] = []
    with model.using_kernels(spy_routes(ops.TORCH, ref_routes)):
        ref = model(tokens).double()
    with model.using_kernels(spy_routes(kernels, got_routes)):
        got = model(tokens).double()
    flips = [(a != b).any(-1) for a, b in zip(ref_routes, got_routes)]
    flipped = torch.stack(flips).any(0)
    row_error = (got - ref).abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-30)
    first_token = int(flipped.nonzero()[0]) if bool(flipped.any()) else len(tokens)
    return {
        "dtype": str(model.dtype), "tokens": len(tokens), "layers": len(flips),
        "tokens_flipped": int(flipped.sum()), "flipped_per_layer": [int(f.sum()) for f in flips],
        "first_flipped_token": first_token if first_token < len(tokens) else None,
        "max": rel_error(got, ref),
        "before_first_flip_max": float(row_error[:first_token].max()) if first_token else None,
        "unflipped_median": float(row_error[~flipped].median()) if bool((~flipped).any()) else None,
        "argmax_agreement": float((got.argmax(-1) == ref.argmax(-1)).double().mean()),
    }


def correctness(ctx: Context) -> None:
    plan, device = ctx.plan, ctx.device
    config = config_for(plan.check_shapes)
    holder: dict[str, Transformer] = {}

    def build() -> None:
        t = time.perf_counter()
        holder["model"] = bench.random_model(config, device, plan.dtype, seed=ctx.args.seed)
        holder["model"].set_kernels(ctx.kernels)
        _free(device)
        ctx.record(2, "model", "ok", layers=config.num_hidden_layers, experts=config.num_experts,
                   hidden=config.hidden_size, vocab=config.vocab_size, dtype=plan.dtype,
                   seconds=round(time.perf_counter() - t, 2))

    run_unit(ctx, 2, "model", 20, build)
    model = holder.get("model")
    if model is None:
        return

    def logits() -> None:
        tokens = torch.tensor(random_prompts([plan.check_prompt_len], config.vocab_size, ctx.args.seed + 1)[0])
        layers = list(range(1, config.num_hidden_layers + 1))
        t = time.perf_counter()
        got_hidden = model.hidden_states(tokens, layers)
        got = model(tokens)
        with model.using_kernels(ops.TORCH):
            ref_hidden = model.hidden_states(tokens, layers)
            ref = model(tokens)
        per_layer = [rel_error(got_hidden[i], ref_hidden[i]) for i in layers]
        worst = max(per_layer + [rel_error(got, ref)])
        argmax_agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        ctx.record(2, "logits_rel_error", "ok" if worst <= LOGITS_REL_TOL else "failed",
                   tokens=len(tokens), per_layer=per_layer, logits=rel_error(got, ref), max=worst,
                   tolerance=LOGITS_REL_TOL, argmax_agreement=argmax_agree, kernels=model.kernels.name,
                   seconds=round(time.perf_counter() - t, 2))

    run_unit(ctx, 2, "logits_rel_error", 20, logits)

    def by_routing(dtype: torch.dtype) -> None:
        t = time.perf_counter()
        tokens = torch.tensor(random_prompts([plan.check_prompt_len], config.vocab_size, ctx.args.seed + 1)[0])
        subject = model if dtype == model.dtype else copy.deepcopy(model).to(dtype)
        figures = logits_by_routing(subject, ctx.kernels, tokens)
        del subject
        _free(device)
        if dtype == torch.float32:  # no flip, or only late ones: the kernels' own error is what is left
            ok = figures["before_first_flip_max"] is not None and figures["before_first_flip_max"] <= FLOAT32_REL_TOL
            figures["tolerance"] = FLOAT32_REL_TOL
        else:  # figures that explain logits_rel_error; the goal stays judged there
            ok = True
        ctx.record(2, f"logits_by_routing_{str(dtype).removeprefix('torch.')}", "ok" if ok else "failed",
                   **figures, seconds=round(time.perf_counter() - t, 2))

    for dtype in dict.fromkeys([model.dtype, torch.float32]):
        run_unit(ctx, 2, f"logits_by_routing_{str(dtype).removeprefix('torch.')}", 20,
                 lambda: by_routing(dtype))
    prompts = random_prompts(plan.greedy_prompt_lens, config.vocab_size, ctx.args.seed + 2)
    eager: dict[str, list[list[int]]] = {}

    def tokens_vs_torch() -> None:
        t = time.perf_counter()
        got, got_logits, _ = greedy(model, prompts, plan.greedy_steps, keep_logits=True)
        with model.using_kernels(ops.TORCH):
            ref, ref_logits, _ = greedy(model, prompts, plan.greedy_steps, keep_logits=True)
        eager["triton"] = got
        ok, figures = compare_tokens(ref, got, ref_logits, got_logits)
        ctx.record(2, "greedy_tokens", "ok" if ok else "failed", prompts=[len(p) for p in prompts],
                   steps=plan.greedy_steps, **figures, seconds=round(time.perf_counter() - t, 2))

    run_unit(ctx, 2, "greedy_tokens", 30, tokens_vs_torch)

    def graph_tokens(name: str) -> None:
        t = time.perf_counter()
        reference = eager.get("triton")
        if reference is None:
            reference, _, _ = greedy(model, prompts, plan.greedy_steps)
        got, _, gen = greedy(model, prompts, plan.greedy_steps, cuda_graph=True)
        ok, figures = compare_tokens(reference, got, [], [])
        ok = ok and (gen.graphs.replays > 0 or name == "fixed_shape_tokens")
        ctx.record(2, name, "ok" if ok else "failed", steps=plan.greedy_steps, **figures,
                   captures=gen.graphs.captures, replays=gen.graphs.replays, seconds=round(time.perf_counter() - t, 2))

    if device.type == "cuda":
        run_unit(ctx, 2, "cuda_graph_tokens", 30, lambda: graph_tokens("cuda_graph_tokens"))
    else:
        # the same padded, fixed-shape decode runs eagerly off CUDA: its tokens are still compared
        run_unit(ctx, 2, "fixed_shape_tokens", 10, lambda: graph_tokens("fixed_shape_tokens"))
        ctx.record(2, "cuda_graph_tokens", "skipped", reason="no CUDA device: graph capture and replay need one")


# -- step 3 ---------------------------------------------------------------------------------


def decode_kernel_times(model: Transformer, batch: int, prompt_len: int, steps: int, seed: int,
                        top: int = 16) -> dict[str, Any]:
    """Device time per kernel of ``steps`` eager decode steps at ``batch`` after a ``prompt_len``
    prefill (torch.profiler: CUDA activity on a GPU, CPU time on the CPU). Where a step's time
    goes: its sum against the step's wall time says how much is launch overhead."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = model.device.type == "cuda"
    gen = BatchedGenerator(model, max_seq_len=prompt_len + steps + 2, max_batch=batch, prefill_chunk=8192)
    g = torch.Generator().manual_seed(seed)
    for prompt in torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g).tolist():
        gen.add(prompt, max_tokens=steps + 1)
    for sid, token in bench.prefill_first_tokens(gen, batch).items():
        gen.update(sid, token)
    _free(model.device)
    with profile(activities=[ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        done, _ = bench.greedy_decode(gen, steps)
        _free(model.device)
        wall = time.perf_counter() - t
    rows = sorted(((getattr(e, "self_device_time_total", 0) if on_cuda else e.self_cpu_time_total, e.key, e.count)
                   for e in prof.key_averages()), reverse=True)
    rows = [r for r in rows if r[0] > 0]
    per = max(done, 1)
    return {"batch": batch, "context": prompt_len, "steps": done, "activity": "cuda" if on_cuda else "cpu",
            "wall_ms_per_step": 1e3 * wall / per, "kernel_ms_per_step": sum(r[0] for r in rows) / 1e3 / per,
            "top": [{"name": name[:80], "ms_per_step": round(us / 1e3 / per, 4), "calls_per_step": count / per}
                    for us, name, count in rows[:top]]}


def speed(ctx: Context) -> None:
    plan, device = ctx.plan, ctx.device
    config = config_for(plan.speed_shapes)
    holder: dict[str, Transformer] = {}

    def build() -> None:
        t = time.perf_counter()
        holder["model"] = bench.random_model(config, device, plan.dtype, seed=ctx.args.seed)
        holder["model"].set_kernels(ctx.kernels)
        _free(device)
        ctx.record(3, "model", "ok", layers=config.num_hidden_layers, experts=config.num_experts,
                   weight_gb=bench.weight_bytes(config)["total"] / bench.GB, dtype=plan.dtype,
                   seconds=round(time.perf_counter() - t, 2))

    run_unit(ctx, 3, "model", 30, build)
    model = holder.get("model")
    if model is None:
        return
    runs: dict[tuple[str, bool, int], Any] = {}

    def timed(path: str, batch: int, cuda_graph: bool, new_tokens: int) -> None:
        t = time.perf_counter()
        if not plan.dry_run:  # untimed, same shapes: every kernel variant compiled (and graphs captured) first
            bench.run_batch(model, batch, plan.prompt_len, new_tokens, plan.prefill_chunk, "warmup",
                            ctx.args.seed + 1, cuda_graph, decode_steps=3)
        r = bench.run_batch(model, batch, plan.prompt_len, new_tokens, plan.prefill_chunk, path, ctx.args.seed,
                            cuda_graph)
        runs[(path, cuda_graph, batch)] = r
        ok = r.decode_tokens_per_s > 0 and r.prefill_tokens_per_s > 0 and r.decode_steps == new_tokens - 1
        figures = asdict(r)
        figures.update(figure="decode", cuda_graph=cuda_graph, seconds=round(time.perf_counter() - t, 2))
        if batch == 128 and path != "torch":
            figures.update(goal_tokens_per_s=bench.BATCH128_GOAL, vllm_tokens_per_s=bench.VLLM_BATCH128,
                           goal_met=r.decode_tokens_per_s >= bench.BATCH128_GOAL)
        ctx.record(3, f"decode_{'graph' if cuda_graph else 'eager'}_batch{batch}" if path != "torch"
                   else f"decode_torch_batch{batch}", "ok" if ok else "failed", **figures)

    need = 40  # a warm batch-128 run at 20b shapes takes tens of seconds: ask for that much before each
    for batch in plan.batches:
        run_unit(ctx, 3, f"decode_eager_batch{batch}", need,
                 lambda: timed(ctx.kernels.name, batch, False, plan.new_tokens))
    for batch in plan.batches:
        if device.type == "cuda":
            run_unit(ctx, 3, f"decode_graph_batch{batch}", need,
                     lambda: timed(ctx.kernels.name, batch, True, plan.new_tokens))
        else:
            ctx.record(3, f"decode_graph_batch{batch}", "skipped",
                       reason="no CUDA device: graph capture and replay need one")

    def prefill() -> None:
        eager = {b: r for (path, graph, b), r in runs.items() if path != "torch" and not graph}
        if not eager:
            raise RuntimeError("no eager decode run finished: no prefill figures")
        ctx.record(3, "prefill", "ok", prompt_len=plan.prompt_len,
                   tokens_per_s={str(b): r.prefill_tokens_per_s for b, r in sorted(eager.items())})

    run_unit(ctx, 3, "prefill", 0, prefill)

    def roofline() -> None:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        peak, source = peak_bandwidth(name, ctx.args.peak_tbps)
        bandwidth = bench.copy_bandwidth(device, int(plan.copy_gb * bench.GB))
        done = False
        for graph in (False, True):
            r = runs.get((ctx.kernels.name, graph, 1))
            if r is None:
                continue
            roof = bench.roofline(config, r, bandwidth, peak)
            done = True
            ctx.record(3, f"roofline_batch1_{'graph' if graph else 'eager'}", "ok", **roof, peak_source=source,
                       decode_tokens_per_s=r.decode_tokens_per_s, goal_fraction=ROOFLINE_GOAL,
                       goal_met=roof["fraction"] >= ROOFLINE_GOAL)
        if not done:
            raise RuntimeError("no batch-1 decode run finished: no roofline")

    run_unit(ctx, 3, "roofline_batch1", 5, roofline)

    def baseline() -> None:
        with model.using_kernels(ops.TORCH):
            timed("torch", 1, False, plan.baseline_tokens)
        ours, ref = runs.get((ctx.kernels.name, False, 1)), runs[("torch", False, 1)]
        if ours is None:
            raise RuntimeError("no eager batch-1 Triton run finished: no Triton / torch ratio")
        ctx.record(3, "triton_torch_ratio_batch1", "ok", ratio=ours.decode_tokens_per_s / ref.decode_tokens_per_s,
                   triton_tokens_per_s=ours.decode_tokens_per_s, torch_tokens_per_s=ref.decode_tokens_per_s)

    run_unit(ctx, 3, "decode_torch_batch1", 45, baseline)

    def launches(path: str, kernels: ops.Kernels, batch: int) -> None:
        c = bench.count_decode_launches(model, batch, plan.prompt_len, plan.prefill_chunk, kernels)
        ok = int(c["total"]) > 0 and (path == "torch" or int(c["triton"]) > 0)
        ctx.record(3, f"launches_{path}_batch{batch}", "ok" if ok else "failed", path=path, context=plan.prompt_len,
                   **c)

    for batch in plan.launch_batches:
        run_unit(ctx, 3, f"launches_triton_batch{batch}", 15,
                 lambda: launches("triton", ctx.kernels, batch))
    run_unit(ctx, 3, "launches_torch_batch1", 15, lambda: launches("torch", ops.TORCH, 1))

    def kernel_time(batch: int) -> None:
        t = time.perf_counter()
        decode_kernel_times(model, batch, plan.prompt_len, 3, ctx.args.seed)  # warm: every variant compiled
        figures = decode_kernel_times(model, batch, plan.prompt_len, 8, ctx.args.seed)
        ok = figures["steps"] > 0 and figures["kernel_ms_per_step"] > 0
        ctx.record(3, f"decode_kernel_time_batch{batch}", "ok" if ok else "failed", **figures,
                   seconds=round(time.perf_counter() - t, 2))

    for batch in dict.fromkeys([1, max(plan.batches)]):
        run_unit(ctx, 3, f"decode_kernel_time_batch{batch}", 25, lambda: kernel_time(batch))


# -- step 4 ---------------------------------------------------------------------------------


def sweep(ctx: Context) -> None:
    from refinery.kernels import moe_tune, triton_moe

    plan = ctx.plan
    found: list[dict[str, Any]] = []
    configs = [triton_moe.MoEConfig(**c) for c in plan.sweep_configs]
    for n in plan.sweep_tokens:
        def one() -> None:
            t = time.perf_counter()
            best = moe_tune.sweep(**plan.sweep_shapes, token_counts=[n], configs=configs, device=ctx.device,
                                  dtype=plan.dtype, repeats=plan.sweep_repeats, seed=ctx.args.seed)
            found.extend(best)
            ctx.record(4, f"moe_sweep_tokens{n}", "ok" if best else "failed", tokens=n, candidates=len(configs),
                       best=best, seconds=round(time.perf_counter() - t, 1))

        # one candidate compiles and times in a second or two on the GPU
        run_unit(ctx, 4, f"moe_sweep_tokens{n}", 2.0 * len(configs), one)
    if found:
        path = ctx.record.path.with_name(ctx.record.path.stem + ".moe_tuned.json")
        moe_tune.write(found, path)
        ctx.record(4, "moe_tuned_file", "ok", path=path, entries=len(found))


# ---- main --------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, Triton interpreted")
    p.add_argument("--out", type=Path, help="the JSON lines file (default $OUT/gpu_check.jsonl, else the temp folder)")
    p.add_argument("--budget-s", type=float, help="stop starting work after this many seconds (default 420; "
                   "dry run 300, a guard: its units all run, or it fails)")
    p.add_argument("--steps", type=_ints, default=[1, 2, 3, 4], help="which steps to run (default 1,2,3,4)")
    p.add_argument("--batches", type=_ints, help="step 3's batch sizes (default 1,32,128; dry run 1,2)")
    p.add_argument("--prompt-len", type=int, help="step 3's prompt tokens per sequence (default 1024)")
    p.add_argument("--new-tokens", type=int, help="step 3's generated tokens per sequence (default 128)")
    p.add_argument("--peak-tbps", type=float, help="the GPU's peak memory bandwidth (default: from its name)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--imports-only", action="store_true",
                   help="import every module the steps use (the Triton kernels too), then exit")
    args = p.parse_args(argv)
    if args.new_tokens is not None and args.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (the first comes from prefill)")
    if args.prompt_len is not None and args.prompt_len < 1:
        p.error("--prompt-len must be at least 1")
    if set(args.steps) - {1, 2, 3, 4}:
        p.error(f"--steps are 1 to 4, not {sorted(set(args.steps) - {1, 2, 3, 4})}")
    if args.budget_s is None:
        args.budget_s = 300.0 if args.dry_run else 420.0
    if args.out is None:
        out = os.environ.get("OUT")
        args.out = Path(out) / "gpu_check.jsonl" if out else Path(tempfile.gettempdir()) / (
            "gpu_check_dry_run.jsonl" if args.dry_run else "gpu_check.jsonl")
    return args


def engine_kernels(dry_run: bool) -> ops.Kernels:
    """The Triton set: interpreted on CPU tensors in a dry run, compiled otherwise."""
    if dry_run:
        from refinery.kernels.interpret import interpreted_triton_kernels

        return interpreted_triton_kernels()
    return ops.triton_kernels()


def machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "refinery_from": REFINERY_SOURCE, "host": platform.node()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as e:
        info["triton"] = f"missing: {e}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=torch.cuda.get_device_name(device), capability=list(torch.cuda.get_device_capability(device)),
                    gpu_memory_gb=props.total_memory / 1e9, multiprocessors=props.multi_processor_count,
                    cuda=torch.version.cuda)
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                        timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.imports_only:
        engine_kernels(True)
        from refinery.kernels import moe_tune  # noqa: F401

        print(json.dumps({"imports": "ok", "refinery_from": REFINERY_SOURCE,
                          "modules": sorted(m for m in sys.modules if m.startswith("refinery"))}))
        return 0
    if args.dry_run:
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("bench/gpu_check.py needs a CUDA GPU and torch.cuda.is_available() is False here; nothing was "
                  "measured (--dry-run runs the same steps on the CPU)", file=sys.stderr)
            return 2
        if os.environ.pop("TRITON_INTERPRET", None):
            print("bench/gpu_check.py: TRITON_INTERPRET was set; unset for this run (the kernels must compile)",
                  file=sys.stderr)
        device = torch.device("cuda")
    plan = make_plan(args)
    started = time.perf_counter()
    record = Recorder(args.out, {"dry_run": plan.dry_run})
    record(0, "machine", "ok", device=device, **machine(device), argv=sys.argv[1:] if argv is None else argv,
           budget_s=args.budget_s, plan=asdict(plan))
    budget = Budget(args.budget_s)
    try:
        kernels = engine_kernels(plan.dry_run)
    except Exception as e:  # noqa: BLE001 - recorded: without its kernels steps 2-4 cannot run
        record(0, "triton_kernels", "error", **error_figures(e))
        kernels = None
    steps: dict[int, Callable[[Context], None]] = {1: kernel_tests, 2: correctness, 3: speed, 4: sweep}
    for number in sorted(args.steps):
        if kernels is None and number > 1:
            record(number, f"step{number}", "skipped", reason="the Triton kernels did not load")
            continue
        ctx = Context(args, plan, device, kernels or ops.TORCH, record, budget)
        run_unit(ctx, number, f"step{number}", 0, lambda: steps[number](ctx))
        gc.collect()  # the step's model goes before the next one is built
        _free(device)
    bad = [f"{r['step']}:{r['name']} ({r['status']})" for r in record.records
           if r["status"] in ("failed", "error")
           or (plan.dry_run and r["status"] == "skipped" and r.get("reason") == "budget")]  # a dry run runs all
    skipped = [f"{r['step']}:{r['name']}" for r in record.records if r["status"] == "skipped"]
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    record(5, "summary", "failed" if bad else "ok", seconds=round(time.perf_counter() - started, 1),
           cpu_s=round(sum(u.ru_utime + u.ru_stime for u in usage), 1),
           records=len(record.records), failed=bad, skipped=skipped, out=args.out)
    record.close()
    if bad:
        print(f"bench/gpu_check.py: {len(bad)} record(s) failed: {', '.join(bad)}; all figures in {args.out}",
              file=sys.stderr)
        return 1
    print(f"bench/gpu_check.py: every record passed ({len(skipped)} skipped); figures in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
